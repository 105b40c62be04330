// EXPECT-ERROR: include_kvc_runtime_hpp_to_read_json
// <kvc/kvc.hpp> leaves the JSON reader out (it is in <kvc/config_json.hpp>, part of
// <kvc/runtime.hpp>): a call to ModelConfig::from_json without it names the header to include.
#include <kvc/kvc.hpp>
#ifndef KVC_SHOULD_FAIL
#include <kvc/runtime.hpp>
#endif

int main() { return kvc::ModelConfig::from_json(R"({"num_hidden_layers": 2})").num_hidden_layers == 2 ? 0 : 1; }
