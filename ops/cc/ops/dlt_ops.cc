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
empty. TF_DLT_PSERVERS (comma-separated) replaces non-empty addresses. The
auth token is no attribute (graphs and SavedModels would hold it): it is the
one this process set for the client's shared_name (dlt::SetClientToken), else
the contents of the file TF_DLT_AUTH_TOKEN_FILE names. auth_token: only for
graphs written before that; tf_dlt never sets it.
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
    .Attr("pulls_per_batch: int >= 1 = 1")
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
is still stale then; without, it uses the rows as pulled. A lookup drops
the table's pulls of earlier batches that no lookup took; a batch is
`pulls_per_batch` consecutive pulls of the table (2 for a table that two
model inputs share), so the lookups of one batch never drop each other's
pulls.
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

REGISTER_OP("Dlt>Regreet")
    .Input("client: resource")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Greets every shard again as a new client would: the newest copy its addresses
serve, of whatever lineage. Before a checkpoint is loaded onto every shard, so
that a shard restarted since (its rows replaced by the load) fails none of this
client's later calls with DataLossError.
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
