#include "native/net/auth_tokens.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "native/net/wire.h"

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

std::string SavedClientName(const std::string& name) {
  // TensorFlow's SavedModel loader appends "_load_<uid>", then possibly
  // "_<uid>" more, to every shared_name it loads.
  const size_t at = name.rfind("_load_");
  if (at == std::string::npos || at + 6 == name.size()) return name;
  for (size_t i = at + 6; i < name.size(); ++i) {
    const char c = name[i];
    if (!(c >= '0' && c <= '9') && !(c == '_' && name[i - 1] != '_')) return name;
  }
  return name.back() == '_' ? name : name.substr(0, at);
}

std::string ClientToken(const std::string& name) {
  std::lock_guard<std::mutex> lock(TokensMutex());
  auto it = Tokens().find(name);
  if (it == Tokens().end()) it = Tokens().find(SavedClientName(name));
  return it == Tokens().end() ? std::string() : it->second;
}

Status CheckToken(const std::string& token, const std::string& what) {
  if (token.size() > wire::kMaxTokenBytes) {
    return InvalidArgument(what + " holds more than " + std::to_string(wire::kMaxTokenBytes) +
                           " bytes; a token has at most " + std::to_string(wire::kMaxTokenBytes) +
                           " (the wrong file?)");
  }
  for (const char ch : token) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c > 0x7e) {
      return InvalidArgument(what +
                             " holds a character a request header cannot carry: a token is "
                             "printable ASCII, without line breaks");
    }
  }
  return OkStatus();
}

Status ReadTokenFile(const std::string& path, const std::string& named_by, std::string* token) {
  const std::string what = "the auth token file " + named_by + " names";
  // open() would read a path with a NUL as the part before it.
  if (path.find('\0') != std::string::npos) {
    return FailedPrecondition("cannot read " + what + ": the path holds a NUL byte");
  }
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return FailedPrecondition("cannot read " + what + ": " + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return FailedPrecondition("cannot read " + what + ": not a regular file");
  }
  // Past the limit by more than whitespace explains: refused below unread.
  std::string read(2 * wire::kMaxTokenBytes + 4096, '\0');
  size_t got = 0;
  while (got < read.size()) {
    const ssize_t n = ::read(fd, &read[got], read.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return FailedPrecondition("cannot read " + what + ": " + std::strerror(err));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  read.resize(got);
  size_t begin = 0, end = read.size();
  auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  while (begin < end && space(read[begin])) ++begin;
  while (end > begin && space(read[end - 1])) --end;
  if (begin == end) return FailedPrecondition(what + " is empty");
  std::string found = read.substr(begin, end - begin);
  const Status checked = CheckToken(found, what);
  if (!checked.ok()) return FailedPrecondition(checked.message());
  *token = std::move(found);
  return OkStatus();
}

}  // namespace dlt
