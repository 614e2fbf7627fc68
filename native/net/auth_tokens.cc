#include "native/net/auth_tokens.h"

#include <map>
#include <mutex>

namespace dlt {
namespace {

std::mutex& TokensMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

std::map<std::string, std::string>& Tokens() {
  static auto* tokens = new std::map<std::string, std::string>;
  return *tokens;
}

}  // namespace

void SetClientToken(const std::string& name, const std::string& token) {
  std::lock_guard<std::mutex> lock(TokensMutex());
  if (token.empty()) {
    Tokens().erase(name);
  } else {
    Tokens()[name] = token;
  }
}

std::string ClientToken(const std::string& name) {
  std::lock_guard<std::mutex> lock(TokensMutex());
  const auto it = Tokens().find(name);
  return it == Tokens().end() ? std::string() : it->second;
}

}  // namespace dlt
