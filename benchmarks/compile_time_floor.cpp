// Compile-time probe, the floor (benchmarks/compile_time.sh): the dependencies of <kvc/kvc.hpp> and
// nothing of kvc: every standard, POSIX, Eigen and Boost.Mp11 header kvc's host headers include.
// What <kvc/kvc.hpp> costs above this is kvc's own share of a translation unit.
#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <unistd.h>

#include <Eigen/Core>
#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>
#include <unsupported/Eigen/CXX11/Tensor>

// Something to compile, so that the object file is not empty.
float kvc_compile_time_floor(const Eigen::Tensor<float, 4, Eigen::RowMajor>& t) { return t.data()[0]; }
