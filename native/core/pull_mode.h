// How a pull treats ids a table does not hold, shared by the table, the
// wire protocol and the clients (which need nothing else of the table).
#ifndef TF_DLT_NATIVE_CORE_PULL_MODE_H_
#define TF_DLT_NATIVE_CORE_PULL_MODE_H_

#include <cstdint>

namespace dlt {

// What a pull does with an id the table does not hold yet.
enum class PullMode : uint8_t {
  kInsert = 0,         // training: create the row with its initial value
  kInitNoInsert = 1,   // inference: return the initial value, insert nothing
  kZerosNoInsert = 2,  // inference: return zeros, insert nothing
  // A row with its optimizer state (a trainer's hot-row cache fills from
  // it): StateFloats(dim, slots) floats per id, inserting nothing; see
  // Table::Pull.
  kState = 3,
};
// The modes' names (index = value), as tf_dlt._native.PULL_MODES has them.
inline constexpr const char* kPullModeNames[] = {"insert", "init", "zeros", "state"};

// Floats per row of a kState pull: the values, the optimizer slots, and
// the row's step as the bits of a uint32 (kNoState: the table holds no
// row for the id in RAM; values and slots are then zeros).
inline uint32_t StateFloats(uint32_t dim, uint32_t slot_floats) { return dim + slot_floats + 1; }

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_PULL_MODE_H_
