// The auth tokens of this process's data-plane clients, by client name.
// Python (tf_dlt.ops.ClientResource) sets a client's token here and the op
// library's Dlt>Client kernel reads it (both link the one libdlt_core.so),
// so a token is never an op attribute, and never in a graph or SavedModel.
// A process that loads a SavedModel without tf_dlt's Python names a token
// file in TF_DLT_AUTH_TOKEN_FILE instead (docs/security.md).
#ifndef TF_DLT_NATIVE_NET_AUTH_TOKENS_H_
#define TF_DLT_NATIVE_NET_AUTH_TOKENS_H_

#include <string>

#include "native/core/status.h"

namespace dlt {

// Sets (or with an empty token, forgets) the token of client `name`.
void SetClientToken(const std::string& name, const std::string& token);
// The token of client `name`; "" when none was set. A client of a
// SavedModel loaded in the process that made it (its shared_name given a
// suffix by the loader, SavedClientName) has the token set for the name it
// was saved under: the loaded model failed UNAUTHENTICATED there.
std::string ClientToken(const std::string& name);
// `name` without the suffix TensorFlow's SavedModel loader gives a loaded
// shared_name ("_load_<uid>[_<uid>...]"); `name` itself when it has none.
std::string SavedClientName(const std::string& name);

// OK when every request can carry `token`: at most wire::kMaxTokenBytes
// of printable ASCII (a gRPC header carries it to the control plane).
// Otherwise InvalidArgument naming `what`, never the token.
Status CheckToken(const std::string& token, const std::string& what);

// The token in file `path` (surrounding whitespace dropped), for the op
// kernel and tf_dlt's Python alike (client.read_token_file calls it): a
// regular file only (a FIFO would block, a device never end), a few KiB of
// it at most, holding a token CheckToken accepts. Errors are
// FailedPrecondition naming `named_by` (the variable or flag), never the
// path or token: a token pasted where its file goes would be printed.
Status ReadTokenFile(const std::string& path, const std::string& named_by, std::string* token);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_AUTH_TOKENS_H_
