// Registrations of the Dlt> ops: inputs, attrs, shape functions. No kernels
// here (they live in ops/cc/kernels/). Every op touching the shards or the
// embedded tables is stateful, so TF never folds, dedups or caches it.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Rows copied out of a table: ids [n], values [n, dim], slots [n, k],
// steps [n] and, for chunks, buckets [n].
absl::Status ExportedRowsShape(InferenceContext* c) {
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
  c->set_output(1, c->Matrix(InferenceContext::kUnknownDim, dim));
  c->set_output(2, c->Matrix(InferenceContext::kUnknownDim, InferenceContext::kUnknownDim));
  for (int i = 3; i < c->num_outputs(); ++i) {
    c->set_output(i, c->Vector(InferenceContext::kUnknownDim));
  }
  return absl::OkStatus();
}

REGISTER_OP("Dlt>Client")
    .Output("handle: resource")
    .Attr("addresses: list(string) = []")
    .Attr("auth_token: string = ''")
    .Attr("connect_timeout_ms: int = 5000")
    .Attr("request_timeout_ms: int = 30000")
    .Attr("frame_bytes: int = 8388608")
    .Attr("max_inflight_pushes: int = 4")
    .Attr("container: string = ''")
    .Attr("shared_name: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
A client of the distributed tables: TCP to the shard servers at `addresses`
(in shard-index order), or the embedded in-process tables when `addresses` is
empty. TF_DLT_PSERVERS (comma-separated) replaces non-empty addresses.
)doc");

REGISTER_OP("Dlt>CreateTable")
    .Input("client: resource")
    .Attr("config: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Creates a table in an embedded client (idempotent for an identical config).
config: the table's configuration as dlt::EncodeTableConfig writes it
(tf_dlt.ops.create_table makes it from a tf_dlt.TableConfig).
)doc");

REGISTER_OP("Dlt>ConfigureCache")
    .Input("client: resource")
    .Attr("config: string")
    .Attr("rows: int >= 0")
    .Attr("max_staleness_steps: int >= 0 = 0")
    .Attr("max_staleness_ms: int >= 0 = 0")
    .Attr("min_count: int = 2")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Keeps a hot-row cache of the table `config` describes in a client of shard
servers (a no-op for an embedded client): at most `rows` rows of ids looked up
`min_count` times, with their optimizer state; the client's pushes are applied
to them with the table's optimizer, and a row is pulled again once it is
`max_staleness_steps` lookups or `max_staleness_ms` old. rows 0 removes it.
)doc");

REGISTER_OP("Dlt>DropTable")
    .Input("client: resource")
    .Attr("table: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Drops a table of an embedded client (NOT_FOUND when it has none).
)doc");

REGISTER_OP("Dlt>Lookup")
    .Input("client: resource")
    .Input("ids: int64")
    .Output("rows: float")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .Attr("training: bool = true")
    .Attr("missing: {'init', 'zeros'} = 'init'")
    .SetIsStateful()
    // Talks to shard servers: TF keeps its UnavailableError (a lost shard)
    // instead of turning it into InternalError inside graphs.
    .SetIsDistributedCommunication()
    .SetShapeFn([](InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->input(1), c->Vector(dim), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Rows of `ids` (any shape): float32 ids.shape + [dim]. With training, unseen
ids are inserted with their initial value; otherwise nothing is inserted and
unseen ids read as their initial value (missing='init') or zeros.
)doc");

REGISTER_OP("Dlt>PullAhead")
    .Input("client: resource")
    .Input("ids: int64")
    .Output("ids_out: int64")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .Attr("training: bool = true")
    .Attr("missing: {'init', 'zeros'} = 'init'")
    .Attr("refresh: bool = true")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Starts pulling the rows of `ids` for a later Dlt>Lookup of exactly these ids
(same table, dim, training and missing) and returns `ids` at once. Remote
clients only; an embedded client just returns `ids`. With refresh, every id
this client pushes or assigns while the pull waits is pulled again, ahead on
the client's worker threads, and the lookup that takes the rows pulls what
is still stale then; without, it uses the rows as pulled.
)doc");

REGISTER_OP("Dlt>LookupGrad")
    .Input("ids: int64")
    .Input("grads: float")
    .Output("unique_ids: int64")
    .Output("summed_grads: float")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle grads;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &grads));
      DimensionHandle dim = c->Dim(grads, -1);
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->Matrix(InferenceContext::kUnknownDim, dim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Turns the gradient of looked-up rows (ids.shape + [dim]) into one summed
gradient row per distinct id, in order of first appearance.
)doc");

REGISTER_OP("Dlt>Push")
    .Input("client: resource")
    .Input("unique_ids: int64")
    .Input("grads: float")
    .Input("learning_rate: float")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .Attr("sync: bool = false")
    .SetIsStateful()
    // Talks to shard servers: TF keeps its UnavailableError (a lost shard)
    // instead of turning it into InternalError inside graphs.
    .SetIsDistributedCommunication()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Sends gradient rows to the shards, which apply the table's optimizer with
`learning_rate`. Asynchronous unless `sync`: it returns once the push is
admitted (at most max_inflight_pushes in flight); errors of earlier pushes
surface at the next Push or Flush.
)doc");

REGISTER_OP("Dlt>Assign")
    .Input("client: resource")
    .Input("ids: int64")
    .Input("values: float")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    // Talks to shard servers: TF keeps its UnavailableError (a lost shard)
    // instead of turning it into InternalError inside graphs.
    .SetIsDistributedCommunication()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Sets the rows of `ids` ([n]) to `values` ([n, dim]) with fresh optimizer
slots, e.g. to upload an existing embedding. Synchronous.
)doc");

REGISTER_OP("Dlt>ExportTable")
    .Input("client: resource")
    .Output("ids: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("steps: int64")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(ExportedRowsShape)
    .Doc(R"doc(
Every row of an embedded table: ids [n], values [n, dim], optimizer slots
[n, slot_floats] and step counts [n]. Tables on shard servers are exported
with tf_dlt.Client.save.
)doc");

REGISTER_OP("Dlt>ExportChunk")
    .Input("client: resource")
    .Input("start: bool")
    .Output("ids: int64")
    .Output("values: float")
    .Output("slots: float")
    .Output("steps: int64")
    .Output("buckets: int32")
    .Output("touched: int64")
    .Output("removed: int64")
    .Output("base_clock: int64")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .Attr("max_rows: int >= 1 = 65536")
    .Attr("save_id: string = ''")
    .Attr("base: string = ''")
    .SetIsStateful()
    .SetShapeFn(ExportedRowsShape)
    .Doc(R"doc(
The next rows (at most max_rows) of an embedded table in (bucket, id) order,
as Dlt>ExportTable returns them plus each id's routing bucket and
last-touched stamp (in the table's clock); `start`
begins a new pass. Empty outputs: the pass is complete. Saving a table chunk
by chunk never holds a second copy of it.

With `save_id`, the pass is that save of the table on top of save `base`:
when the table tracks `base`, only the rows changed since it are exported,
`base_clock` is [the table's clock at the base] ([] when every row is
exported), and the call that completes the pass returns in `removed` the
ids removed since the base, sorted by (bucket, id).
)doc");

REGISTER_OP("Dlt>ImportTable")
    .Input("client: resource")
    .Input("ids: int64")
    .Input("values: float")
    .Input("slots: float")
    .Input("steps: int64")
    .Input("touched: int64")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Inserts or overwrites rows of an embedded table with their optimizer slots,
step counts and last-touched stamps (empty `touched`: now); the inverse of
Dlt>ExportChunk.
)doc");

REGISTER_OP("Dlt>TableState")
    .Input("client: resource")
    .Output("clock: int64")
    .Output("sketch: uint8")
    .Output("added: int64")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Matrix(InferenceContext::kUnknownDim, InferenceContext::kUnknownDim));
      c->set_output(2, c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
An embedded table's clock (pushes taken, or seconds) and, with Frequency
admission, its sketch: one slice of counters per routing bucket [4096,
bytes] and the pushes each slice counted since it last halved [4096]
(empty without a sketch).
)doc");

REGISTER_OP("Dlt>SetTableState")
    .Input("client: resource")
    .Input("clock: int64")
    .Input("first_bucket: int64")
    .Input("sketch: uint8")
    .Input("added: int64")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Sets an embedded table's push clock and the sketch slices of buckets
[first_bucket, first_bucket + buckets) (the inverse of Dlt>TableState).
)doc");

REGISTER_OP("Dlt>MarkTableLoaded")
    .Input("client: resource")
    .Attr("table: string")
    .Attr("dim: int >= 1")
    .Attr("save_id: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
An embedded table now holds checkpoint `save_id` exactly (it was loaded
from it): the next delta save on top of that checkpoint writes only the rows
changed after this call.
)doc");

REGISTER_OP("Dlt>Flush")
    .Input("client: resource")
    .SetIsStateful()
    // Talks to shard servers: TF keeps its UnavailableError (a lost shard)
    // instead of turning it into InternalError inside graphs.
    .SetIsDistributedCommunication()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Waits until every push admitted before it has been applied; raises the first
error of those pushes.
)doc");

REGISTER_OP("Dlt>DropPulledAhead")
    .Input("client: resource")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Drops every pull ahead (Dlt>PullAhead) of this client that no lookup took yet:
the input pipeline that began them stopped. Later lookups pull their rows.
)doc");

REGISTER_OP("Dlt>ClientStats")
    .Input("client: resource")
    .Output("stats: string")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc(R"doc(
This client's counters as a JSON object: pulls, pushes, rows, payload bytes,
failed calls, pushes in flight and waiting, pull and push latency histograms.
)doc");

}  // namespace
}  // namespace tensorflow
