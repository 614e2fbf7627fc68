// Kernels of Dlt>Client (creates or finds the ClientResource),
// Dlt>ConfigureCache, Dlt>Flush, Dlt>DropPulledAhead and Dlt>ClientStats.
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "native/net/auth_tokens.h"
#include "native/net/socket.h"
#include "ops/cc/kernels/client_resource.h"
#include "ops/cc/kernels/status_util.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_op_kernel.h"

namespace tensorflow {
namespace dlt_ops {
namespace {

// The one documented override: TF_DLT_PSERVERS replaces the shard addresses
// of a non-embedded client, so a graph (a SavedModel) can be pointed at other
// servers where it is loaded.
constexpr char kPserversEnv[] = "TF_DLT_PSERVERS";
// Where a client's auth token comes from when no process code set it
// (dlt::SetClientToken): a file named by this variable, e.g. a Kubernetes
// Secret mounted in a serving pod. Tokens are never op attributes.
constexpr char kTokenFileEnv[] = "TF_DLT_AUTH_TOKEN_FILE";

// The auth token of client `name`: set by this process (tf_dlt.ops), else
// read from the file TF_DLT_AUTH_TOKEN_FILE names (trailing whitespace
// dropped), else none.
absl::Status TokenOf(const std::string& name, std::string* token) {
  *token = dlt::ClientToken(name);
  const char* path = std::getenv(kTokenFileEnv);
  if (!token->empty() || path == nullptr || *path == '\0') return absl::OkStatus();
  // Read as tf_dlt's Python reads it (surrounding whitespace dropped, as the
  // shards drop it from theirs); errors never name the path.
  const dlt::Status read = dlt::ReadTokenFile(path, kTokenFileEnv, token);
  if (!read.ok()) return errors::FailedPrecondition(read.message());
  return absl::OkStatus();
}

class ClientOp : public ResourceOpKernel<ClientResource> {
 public:
  explicit ClientOp(OpKernelConstruction* ctx) : ResourceOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("addresses", &options_.addresses));
    // Graphs written before tokens left the attributes may still hold one.
    OP_REQUIRES_OK(ctx, ctx->GetAttr("auth_token", &options_.tcp.auth_token));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &name_));
    int64_t connect_ms, request_ms, frame_bytes, inflight;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("connect_timeout_ms", &connect_ms));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("request_timeout_ms", &request_ms));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("frame_bytes", &frame_bytes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_inflight_pushes", &inflight));
    // Milliseconds in an int: a longer deadline wrapped to a negative one.
    constexpr int64_t kMaxMs = std::numeric_limits<int>::max();
    OP_REQUIRES(ctx,
                connect_ms > 0 && request_ms > 0 && connect_ms <= kMaxMs && request_ms <= kMaxMs,
                errors::InvalidArgument("Dlt>Client timeouts must be in [1, ", kMaxMs,
                                        "] ms (24.8 days), got ", connect_ms, " and ", request_ms));
    OP_REQUIRES(ctx, frame_bytes >= 4096 && frame_bytes <= (int64_t{1} << 31),
                errors::InvalidArgument("frame_bytes must be in [4096, 2^31], got ", frame_bytes));
    constexpr int64_t kMaxInflight = std::numeric_limits<int>::max();
    OP_REQUIRES(ctx, inflight >= 1 && inflight <= kMaxInflight,
                errors::InvalidArgument("max_inflight_pushes must be in [1, ", kMaxInflight,
                                        "], got ", inflight));
    options_.tcp.connect_timeout_ms = static_cast<int>(connect_ms);
    options_.tcp.request_timeout_ms = static_cast<int>(request_ms);
    options_.tcp.frame_bytes = static_cast<uint32_t>(frame_bytes);
    options_.max_inflight_pushes = static_cast<int>(inflight);
    const char* override_list = std::getenv(kPserversEnv);
    bool overridden = false;
    if (!options_.addresses.empty() && override_list != nullptr && *override_list != '\0') {
      // "a:1, b:2" as Python's overridden_pservers reads it: each address
      // without the spaces around it.
      std::vector<std::string> addresses;
      for (absl::string_view address : absl::StrSplit(override_list, ',')) {
        address = absl::StripAsciiWhitespace(address);
        if (!address.empty()) addresses.emplace_back(address);
      }
      if (!addresses.empty()) {
        options_.addresses = std::move(addresses);
        overridden = true;
      }
    }
    // A malformed address is the caller's mistake, not a shard that is
    // down: named now, not retried as UNAVAILABLE at the first lookup.
    for (const std::string& address : options_.addresses) {
      for (const std::string& member : dlt::net::SplitAddresses(address)) {
        std::string host;
        int port = 0;
        const dlt::Status s = dlt::net::ParseAddress(member, &host, &port);
        OP_REQUIRES(ctx, s.ok(),
                    errors::InvalidArgument(overridden ? kPserversEnv : "Dlt>Client addresses",
                                            ": ", s.message()));
      }
    }
  }

 private:
  absl::Status CreateResource(ClientResource** resource) override TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.tcp.auth_token.empty() && !options_.addresses.empty()) {
      TF_RETURN_IF_ERROR(TokenOf(name_, &options_.tcp.auth_token));
    }
    *resource = new ClientResource(options_);
    return absl::OkStatus();
  }

  ClientResourceOptions options_;
  std::string name_;  // the client's shared name: the key of its token
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Client").Device(DEVICE_CPU), ClientOp);

class ConfigureCacheOp : public OpKernel {
 public:
  explicit ConfigureCacheOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string text;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("config", &text));
    OP_REQUIRES_OK(ctx,
                   ToAbsl(dlt::DecodeTableConfig(text, &config_), "Dlt>ConfigureCache config"));
    OP_REQUIRES_OK(ctx, ToAbsl(dlt::ValidateTableConfig(config_), "Dlt>ConfigureCache"));
    int64_t rows, steps, ms, min_count;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_staleness_steps", &steps));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("max_staleness_ms", &ms));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("min_count", &min_count));
    OP_REQUIRES(ctx, steps <= UINT32_MAX && ms <= UINT32_MAX,
                errors::InvalidArgument("staleness bounds must be below 2^32"));
    OP_REQUIRES(ctx, min_count >= 0 && min_count <= 255,
                errors::InvalidArgument("min_count must be in [1, 255], got ", min_count));
    options_.max_rows = static_cast<size_t>(rows);
    options_.max_staleness_steps = static_cast<uint32_t>(steps);
    options_.max_staleness_ms = static_cast<uint32_t>(ms);
    options_.min_count = static_cast<uint32_t>(min_count);
  }

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    OP_REQUIRES_OK(ctx, client->ConfigureCache(config_, options_));
  }

 private:
  dlt::TableConfig config_;
  dlt::RowCacheOptions options_;
};

REGISTER_KERNEL_BUILDER(Name("Dlt>ConfigureCache").Device(DEVICE_CPU), ConfigureCacheOp);

class FlushOp : public AsyncOpKernel {
 public:
  explicit FlushOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK_ASYNC(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client), done);
    client->Flush([ctx, done](absl::Status status) {
      ctx->SetStatus(status);
      done();
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("Dlt>Flush").Device(DEVICE_CPU), FlushOp);

// An op whose only input is the client and that calls `Call` on it.
template <absl::Status (*Call)(ClientResource*)>
class ClientCallOp : public OpKernel {
 public:
  explicit ClientCallOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    OP_REQUIRES_OK(ctx, Call(client.get()));
  }
};

absl::Status DropPulledAhead(ClientResource* client) {
  client->DropPulledAhead();
  return absl::OkStatus();
}
absl::Status Regreet(ClientResource* client) { return client->Regreet(); }

REGISTER_KERNEL_BUILDER(Name("Dlt>DropPulledAhead").Device(DEVICE_CPU),
                        ClientCallOp<DropPulledAhead>);
REGISTER_KERNEL_BUILDER(Name("Dlt>Regreet").Device(DEVICE_CPU), ClientCallOp<Regreet>);

class ClientStatsOp : public OpKernel {
 public:
  explicit ClientStatsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    core::RefCountPtr<ClientResource> client;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &client));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tstring>()() = client->StatsJson();
  }
};

REGISTER_KERNEL_BUILDER(Name("Dlt>ClientStats").Device(DEVICE_CPU), ClientStatsOp);

}  // namespace
}  // namespace dlt_ops
}  // namespace tensorflow
