// How a pull treats ids a table does not hold, shared by the table, the
// wire protocol and the clients (which need nothing else of the table).
#ifndef TF_DLT_NATIVE_CORE_PULL_MODE_H_
#define TF_DLT_NATIVE_CORE_PULL_MODE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

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
  // kState for a trainer: an id with no row in RAM is pulled as kInsert
  // pulls it (made, or moved in from disk, where it may be) and, when that
  // leaves it in RAM, its state is returned; otherwise its values, with
  // kNoState. One exchange where kState and a kInsert pull of the absent
  // ids took two.
  kStateInsert = 4,
};
// The modes' names (index = value), as tf_dlt._native.PULL_MODES has them.
inline constexpr const char* kPullModeNames[] = {"insert", "init", "zeros", "state",
                                                 "state_insert"};

// Whether a pull of `mode` returns rows with their state (StateFloats wide).
inline bool IsStatePull(PullMode mode) {
  return mode == PullMode::kState || mode == PullMode::kStateInsert;
}

// Floats per row of a kState pull: the values, the optimizer slots, and
// the row's step as the bits of a uint32 (kNoState: the table holds no
// row for the id in RAM; slots are then zeros, and so are the values of a
// kState pull).
inline uint32_t StateFloats(uint32_t dim, uint32_t slot_floats) { return dim + slot_floats + 1; }
// The step of a state row `width` floats wide (its last float's bits).
inline uint32_t StepOfState(const float* row, size_t width) {
  uint32_t step;
  std::memcpy(&step, row + width - 1, sizeof(step));
  return step;
}

}  // namespace dlt

#endif  // TF_DLT_NATIVE_CORE_PULL_MODE_H_
