// The one doctest main for every tests/unit/*.cpp executable (doctest-dev 2.4.9 ships no
// doctest::doctest_with_main target; see STYLE.md section 0).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
