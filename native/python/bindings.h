// What the binding files of tf_dlt._native share: the array types, raising
// a Status as its tf_dlt.errors class, a table config and the counters to
// and from Python dicts, argument checks; and the function of each binding
// file, called by module.cc in this order. No TF headers.
#ifndef TF_DLT_NATIVE_PYTHON_BINDINGS_H_
#define TF_DLT_NATIVE_PYTHON_BINDINGS_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>

#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif
#include <unistd.h>

#include "native/core/status.h"
#include "native/core/table.h"
#include "native/core/table_config.h"
#include "native/net/server_stats.h"

namespace py = pybind11;

namespace dlt {

using IdArray = py::array_t<int64_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style>;
using StepArray = py::array_t<uint32_t, py::array::c_style>;
using ByteArray = py::array_t<uint8_t, py::array::c_style>;

[[noreturn]] void Raise(const Status& s);

void Check(const Status& s);

// Releases the GIL for its scope, as py::gil_scoped_release does, for every
// binding (a call guard too). A thread that takes the GIL back while the
// interpreter finalizes (a daemon thread of a process that exits) is ended
// there by pthread_exit: its forced unwind met py::gil_scoped_release's
// noexcept destructor, which called std::terminate ("terminate called
// without an active exception": the process aborted). Here that thread
// stops where it stands, as Python 3.14 stops it, until the process ends;
// nothing of Python is touched without the GIL on its way out.
class GilRelease {
 public:
  GilRelease() : state_(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() {
#if defined(__GLIBCXX__)
    try {
      PyEval_RestoreThread(state_);
    } catch (abi::__forced_unwind&) {
      for (;;) pause();  // never rethrown: the handler is never left
    }
#else
    PyEval_RestoreThread(state_);
#endif
  }

 private:
  PyThreadState* state_;
};

// Runs `call` (returning a Status) with the GIL released, then raises its
// error as Check does.
template <typename F>
void CheckWithoutGil(F&& call) {
  Status st;
  {
    GilRelease release;
    st = call();
  }
  Check(st);
}

// A config from its dict form (tf_dlt.TableConfig.to_dict()); parameters
// not given keep their defaults. The field names come from the one list in
// table_config.h.
TableConfig ConfigFromDict(const py::dict& d);

py::dict ConfigToDict(const TableConfig& c);

void CheckRows(const py::array& a, size_t n, size_t width, const char* what);

void CheckIds(const IdArray& ids);

void CopySteps(const py::array& a, size_t n, uint32_t* out);

StepArray StepsFrom(const py::object& steps, size_t n);

py::dict TableCountersToDict(const TableCounters& c);

py::dict TierStatsToDict(const TierStats& t);

py::dict CountersToDict(const ServerCounters& c);

// The classes of each area: Table and its Exporter; Shard and the process's
// embedded shard; the data-plane DataServer and Client.
void BindTable(py::module_& m);
void BindShard(py::module_& m);
void BindNet(py::module_& m);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_PYTHON_BINDINGS_H_
