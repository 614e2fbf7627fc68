// The auth tokens of this process's data-plane clients, by client name.
// Python (tf_dlt.ops.ClientResource) sets a client's token here and the op
// library's Dlt>Client kernel reads it (both link the one libdlt_core.so),
// so a token is never an op attribute, and never in a graph or SavedModel.
// A process that loads a SavedModel without tf_dlt's Python names a token
// file in TF_DLT_AUTH_TOKEN_FILE instead (docs/security.md).
#ifndef TF_DLT_NATIVE_NET_AUTH_TOKENS_H_
#define TF_DLT_NATIVE_NET_AUTH_TOKENS_H_

#include <string>

namespace dlt {

// Sets (or with an empty token, forgets) the token of client `name`.
void SetClientToken(const std::string& name, const std::string& token);
// The token of client `name`; "" when none was set.
std::string ClientToken(const std::string& name);

}  // namespace dlt

#endif  // TF_DLT_NATIVE_NET_AUTH_TOKENS_H_
