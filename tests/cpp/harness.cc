#include "tests/cpp/harness.h"

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dlt {
namespace testing {

std::string g_data_dir;
int g_failures_in_test = 0;

namespace {

std::vector<std::pair<const char*, void (*)()>>& Tests() {
  static auto* tests = new std::vector<std::pair<const char*, void (*)()>>();
  return *tests;
}

}  // namespace

bool Register(const char* name, void (*fn)()) {
  Tests().emplace_back(name, fn);
  return true;
}

}  // namespace testing
}  // namespace dlt

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: native_test <tests/data dir> [test name | --part=K/N | --list]\n");
    return 2;
  }
  dlt::testing::g_data_dir = argv[1];
  if (argc > 2 && std::string(argv[2]) == "--list") {  // every test's name, one a line
    for (const auto& test : dlt::testing::Tests()) std::printf("%s\n", test.first);
    return 0;
  }
  // --part=K/N: the tests whose index is K modulo N (N processes at once
  // share the suite: most of its time is waiting).
  const std::string chosen = argc > 2 ? argv[2] : "";
  size_t part = 0, parts = 0;
  if (chosen.rfind("--part=", 0) == 0) {
    char slash = 0;
    std::istringstream spec(chosen.substr(7));
    if (!(spec >> part >> slash >> parts) || slash != '/' || part >= parts || !spec.eof()) {
      std::fprintf(stderr, "bad %s: want --part=K/N with K < N\n", chosen.c_str());
      return 2;
    }
  }
  // NATIVE_TEST_TIMES=1: each test's wall time on stderr, to find slow ones.
  const bool times = std::getenv("NATIVE_TEST_TIMES") != nullptr;
  int passed = 0, failed = 0;
  const auto& tests = dlt::testing::Tests();
  for (size_t i = 0; i < tests.size(); ++i) {
    const auto& [name, fn] = tests[i];
    if (parts > 0 ? i % parts != part : !chosen.empty() && chosen != name) continue;
    dlt::testing::g_failures_in_test = 0;
    const auto start = std::chrono::steady_clock::now();
    fn();
    std::fflush(stdout);
    if (times) {
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      std::fprintf(stderr, "%8.3f s  %s\n", took.count(), name);
    }
    if (dlt::testing::g_failures_in_test == 0) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAILED %s\n", name);
    }
  }
  if (passed + failed == 0) {  // a misspelled name must not pass as "0 failed"
    std::fprintf(stderr, "no test %s %s\n", parts > 0 ? "in" : "named",
                 argc > 2 ? argv[2] : "(none registered)");
    return 2;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
