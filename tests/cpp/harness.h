// A minimal test harness for the C++ suite (tests/cpp): tests register
// themselves with DLT_TEST; the runner (harness.cc) runs them all and prints
// one line per failure and "N passed, M failed" at the end.
#ifndef TF_DLT_TESTS_CPP_HARNESS_H_
#define TF_DLT_TESTS_CPP_HARNESS_H_

#include <cstdio>
#include <string>

#include "native/core/status.h"

namespace dlt {
namespace testing {

// Where the golden files live (the runner's first argument).
extern std::string g_data_dir;
extern int g_failures_in_test;

bool Register(const char* name, void (*fn)());

// True in the sanitized build: AddressSanitizer replaces malloc (freed
// memory waits in its quarantine and goes back to the system on its own
// schedule), so what a test measures of the process's resident memory says
// nothing there about glibc's malloc, which the shard runs on.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kUnderAddressSanitizer = true;
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif

}  // namespace testing
}  // namespace dlt

#define DLT_TEST(name)                                                                          \
  static void name();                                                                           \
  [[maybe_unused]] static const bool name##_registered = ::dlt::testing::Register(#name, name); \
  static void name()

#define EXPECT(cond)                                                    \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::printf("  %s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      ++::dlt::testing::g_failures_in_test;                             \
    }                                                                   \
  } while (0)

#define EXPECT_OK(expr)                                                                     \
  do {                                                                                      \
    const ::dlt::Status _s = (expr);                                                        \
    if (!_s.ok()) {                                                                         \
      std::printf("  %s:%d: %s -> %s\n", __FILE__, __LINE__, #expr, _s.ToString().c_str()); \
      ++::dlt::testing::g_failures_in_test;                                                 \
    }                                                                                       \
  } while (0)

// A status that failed with a message holding `text`; prints the status when
// it did not.
#define EXPECT_ERROR_HAS(expr, text)                                                            \
  do {                                                                                          \
    const ::dlt::Status _s = (expr);                                                            \
    if (_s.ok() || _s.message().find(text) == std::string::npos) {                              \
      std::printf("  %s:%d: %s -> %s (expected an error holding \"%s\")\n", __FILE__, __LINE__, \
                  #expr, _s.ToString().c_str(), text);                                          \
      ++::dlt::testing::g_failures_in_test;                                                     \
    }                                                                                           \
  } while (0)

#endif  // TF_DLT_TESTS_CPP_HARNESS_H_
