#include "server/tls_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "openssl/asn1.h"
#include "openssl/bio.h"
#include "openssl/crypto.h"
#include "openssl/err.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace eldr::server {

struct TlsFileContents {
  TlsFileContents() = default;
  TlsFileContents(TlsFileContents&&) = default;
  TlsFileContents& operator=(TlsFileContents&&) = default;
  // The key bytes are wiped, not just freed.
  ~TlsFileContents() { OPENSSL_cleanse(key.data(), key.size()); }

  std::string cert;
  std::string key;
  std::string client_ca;  // empty when the set has no client CA file
  std::string digest;     // SHA-256 of cert, of key and of client_ca, concatenated
};

namespace {

constexpr char kCertSetting[] = "tls_cert";
constexpr char kKeySetting[] = "tls_key";
constexpr char kClientCaSetting[] = "tls_client_ca";

// Names inside the mirror folder (see the layout in the header).
constexpr char kCertFileName[] = "tls_cert.pem";
constexpr char kKeyFileName[] = "tls_key.pem";
constexpr char kClientCaFileName[] = "tls_client_ca.pem";
constexpr char kCurrentLinkName[] = "current";
constexpr char kSetPrefix[] = "set-";
constexpr char kTempSuffix[] = ".tmp";
// The current set and the one before it stay on disk: a watcher that read `current` just before a
// swap still finds its files.
constexpr size_t kSetsKept = 2;

// ---- OpenSSL ownership and errors ----

struct BioFree {
  void operator()(BIO* bio) const { BIO_free_all(bio); }
};
struct X509Free {
  void operator()(X509* cert) const { X509_free(cert); }
};
struct EvpPkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
struct OpenSslFree {
  void operator()(void* p) const { OPENSSL_free(p); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using EvpPkeyPtr = std::unique_ptr<EVP_PKEY, EvpPkeyFree>;
using OpenSslString = std::unique_ptr<char, OpenSslFree>;
using OpenSslBytes = std::unique_ptr<unsigned char, OpenSslFree>;

// Empties this thread's OpenSSL error queue on entry and on exit of a scope, so that errors of an
// earlier caller are not reported as ours and ours do not leak to the next caller.
class OpenSslErrorScope {
 public:
  OpenSslErrorScope() { ERR_clear_error(); }
  ~OpenSslErrorScope() { ERR_clear_error(); }
  OpenSslErrorScope(const OpenSslErrorScope&) = delete;
  OpenSslErrorScope& operator=(const OpenSslErrorScope&) = delete;
};

// Drains the error queue into "reason; reason". Only OpenSSL's reason strings are used, never the
// optional data attached to an error, so no input bytes can reach a message.
std::string TakeOpenSslErrors() {
  std::vector<std::string> reasons;
  for (unsigned long error = ERR_get_error(); error != 0; error = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(error);
    std::string text = reason != nullptr ? reason : absl::StrCat("error code ", error);
    if (std::find(reasons.begin(), reasons.end(), text) == reasons.end()) reasons.push_back(std::move(text));
  }
  if (reasons.empty()) return "OpenSSL gave no reason";
  return absl::StrJoin(reasons, "; ");
}

BioPtr MemoryBio(absl::string_view bytes) {
  return BioPtr(BIO_new_mem_buf(bytes.data(), static_cast<int>(bytes.size())));
}

std::string BioText(BIO* bio) {
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio, &data);
  return size > 0 ? std::string(data, static_cast<size_t>(size)) : std::string();
}

// "CN=router.example,O=Example" (RFC 2253 order), cut at 256 characters.
std::string SubjectOf(const X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || X509_NAME_print_ex(bio.get(), X509_get_subject_name(cert), 0, XN_FLAG_RFC2253) < 0) {
    ERR_clear_error();
    return "(subject unreadable)";
  }
  std::string subject = BioText(bio.get());
  if (subject.empty()) return "(empty subject)";
  if (subject.size() > 256) subject = absl::StrCat(subject.substr(0, 256), "...");
  return subject;
}

// "2026-01-31T12:00:00Z".
std::string FormatAsn1Time(const ASN1_TIME* time) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(time, &tm) != 1) {
    ERR_clear_error();
    return "(unreadable time)";
  }
  char text[32];
  if (std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm) == 0) return "(unreadable time)";
  return text;
}

std::string KeyTypeName(const EVP_PKEY* key) {
  const char* name = EVP_PKEY_get0_type_name(key);
  return name != nullptr ? name : "of an unknown type";
}

// ---- Errors ----

absl::Status SettingError(absl::string_view setting, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("setting '", setting, "': ", problem));
}

// The errno's status code; absl::ErrnoToStatus appends the errno's text to the message.
absl::Status MirrorError(absl::string_view mirror_dir, absl::string_view what, int error_number) {
  return absl::ErrnoToStatus(error_number, absl::StrCat("TLS mirror folder '", mirror_dir, "': ", what));
}

// ---- Reading the sources ----

// Reads the whole regular file at `path` (at most kMaxTlsFileBytes) with eldr_common's ReadFile:
// type and size checked before the file is opened and again on the descriptor, nothing left of
// the bytes on an error. Every failure is INVALID_ARGUMENT naming the setting.
absl::StatusOr<std::string> ReadTlsFile(absl::string_view setting, const std::string& path) {
  if (path.empty()) return SettingError(setting, "no file given");
  absl::StatusOr<std::string> data = ReadFile(path, kMaxTlsFileBytes);
  if (!data.ok()) return SettingError(setting, data.status().message());
  if (data->empty()) return SettingError(setting, absl::StrCat("'", path, "' is empty"));
  return data;
}

absl::StatusOr<std::string> Sha256(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr) != 1) {
    return absl::InternalError(absl::StrCat("SHA-256 failed: ", TakeOpenSslErrors()));
  }
  return std::string(reinterpret_cast<const char*>(digest), size);
}

absl::StatusOr<TlsFileContents> ReadTlsContents(const TlsFiles& files) {
  TlsFileContents contents;
  ELDR_ASSIGN_OR_RETURN(contents.cert, ReadTlsFile(kCertSetting, files.cert));
  ELDR_ASSIGN_OR_RETURN(contents.key, ReadTlsFile(kKeySetting, files.key));
  if (!files.client_ca.empty()) {
    ELDR_ASSIGN_OR_RETURN(contents.client_ca, ReadTlsFile(kClientCaSetting, files.client_ca));
  }
  for (const std::string* bytes : {&contents.cert, &contents.key, &contents.client_ca}) {
    ELDR_ASSIGN_OR_RETURN(std::string digest, Sha256(*bytes));
    contents.digest += digest;
  }
  return contents;
}

// ---- Parsing ----

// The labels of the PEM blocks in `text` ("CERTIFICATE, PRIVATE KEY"), for messages. Labels are
// not secret; what lies between the lines is never looked at.
std::string PemBlockLabels(absl::string_view text) {
  constexpr absl::string_view kBegin = "-----BEGIN ";
  std::vector<std::string> labels;
  for (size_t at = text.find(kBegin); at != absl::string_view::npos; at = text.find(kBegin, at + 1)) {
    const size_t start = at + kBegin.size();
    const size_t end = text.find("-----", start);
    if (end == absl::string_view::npos || end - start > 64) continue;
    std::string label(text.substr(start, end - start));
    if (std::find(labels.begin(), labels.end(), label) == labels.end()) labels.push_back(std::move(label));
  }
  return absl::StrJoin(labels, ", ");
}

// Every certificate in the PEM text, in order. Blocks of other types are skipped, as gRPC skips
// them; a malformed block (bad base64, missing end line, a certificate that is not X.509) is an
// error.
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(absl::string_view setting, const std::string& path,
                                                       const std::string& text) {
  BioPtr bio = MemoryBio(text);
  if (bio == nullptr) return absl::ResourceExhaustedError("cannot allocate an OpenSSL memory BIO");
  std::vector<X509Ptr> certs;
  for (int block = 1;; ++block) {
    char* label_raw = nullptr;
    char* header_raw = nullptr;
    unsigned char* der_raw = nullptr;
    long der_size = 0;
    ERR_clear_error();
    if (PEM_read_bio(bio.get(), &label_raw, &header_raw, &der_raw, &der_size) != 1) {
      const unsigned long error = ERR_peek_last_error();
      if (ERR_GET_LIB(error) == ERR_LIB_PEM && ERR_GET_REASON(error) == PEM_R_NO_START_LINE) {
        ERR_clear_error();  // no further block: the normal end
        break;
      }
      return SettingError(setting,
                          absl::StrCat("'", path, "': PEM block ", block, " is malformed (", TakeOpenSslErrors(), ")"));
    }
    const OpenSslString label(label_raw);
    const OpenSslString header(header_raw);
    const OpenSslBytes der(der_raw);
    const absl::string_view type(label_raw);
    const bool trusted = type == PEM_STRING_X509_TRUSTED;
    if (type != PEM_STRING_X509 && type != PEM_STRING_X509_OLD && !trusted) continue;
    const unsigned char* cursor = der_raw;
    X509Ptr cert(trusted ? d2i_X509_AUX(nullptr, &cursor, der_size) : d2i_X509(nullptr, &cursor, der_size));
    if (cert == nullptr) {
      return SettingError(setting, absl::StrCat("'", path, "': certificate ", certs.size() + 1, " (PEM block ", block,
                                                ") is not a valid X.509 certificate (", TakeOpenSslErrors(), ")"));
    }
    certs.push_back(std::move(cert));
  }
  if (certs.empty()) {
    const std::string labels = PemBlockLabels(text);
    std::string hint;
    if (!labels.empty()) {
      hint = absl::StrCat(" (its PEM blocks: ", labels, ")");
    } else if (static_cast<unsigned char>(text[0]) == 0x30) {
      hint = " (it looks like DER; convert it with `openssl x509 -inform der`)";
    }
    return SettingError(setting, absl::StrCat("'", path, "' holds no PEM certificate", hint));
  }
  return certs;
}

// Records that OpenSSL asked for a passphrase, and refuses to give one.
int RefusePassphrase(char* /*buffer*/, int /*size*/, int /*writing*/, void* asked) {
  *static_cast<bool*>(asked) = true;
  return -1;
}

absl::StatusOr<EvpPkeyPtr> ParsePrivateKey(const std::string& path, const std::string& text) {
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return SettingError(kKeySetting, absl::StrCat("'", path, "' holds no PEM block"));
  }
  BioPtr bio = MemoryBio(text);
  if (bio == nullptr) return absl::ResourceExhaustedError("cannot allocate an OpenSSL memory BIO");
  bool passphrase_asked = false;
  ERR_clear_error();
  EvpPkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, RefusePassphrase, &passphrase_asked));
  if (passphrase_asked) {
    ERR_clear_error();
    return SettingError(kKeySetting, absl::StrCat("'", path,
                                                  "' holds an encrypted private key; gRPC cannot ask for a "
                                                  "passphrase: give it the key unencrypted (mode 0600)"));
  }
  if (key == nullptr) {
    return SettingError(kKeySetting,
                        absl::StrCat("'", path, "' holds no private key OpenSSL can read (its PEM blocks: ",
                                     PemBlockLabels(text), "; OpenSSL: ", TakeOpenSslErrors(), ")"));
  }
  ERR_clear_error();  // the decoders may leave errors of the formats they tried first
  return key;
}

absl::Status CheckValidityPeriod(const std::string& path, const X509* leaf) {
  const ASN1_TIME* not_before = X509_get0_notBefore(leaf);
  const ASN1_TIME* not_after = X509_get0_notAfter(leaf);
  // X509_cmp_current_time: -1 when the time is at or before now, 1 when after, 0 on error.
  const int after_vs_now = X509_cmp_current_time(not_after);
  const int before_vs_now = X509_cmp_current_time(not_before);
  if (after_vs_now == 0 || before_vs_now == 0) {
    return SettingError(kCertSetting, absl::StrCat("'", path, "': the validity dates of the certificate (subject ",
                                                   SubjectOf(leaf), ") cannot be read (", TakeOpenSslErrors(), ")"));
  }
  if (after_vs_now < 0) {
    return SettingError(kCertSetting, absl::StrCat("the certificate in '", path, "' (subject ", SubjectOf(leaf),
                                                   ") expired at ", FormatAsn1Time(not_after)));
  }
  if (before_vs_now > 0) {
    return SettingError(kCertSetting, absl::StrCat("the certificate in '", path, "' (subject ", SubjectOf(leaf),
                                                   ") is not valid before ", FormatAsn1Time(not_before)));
  }
  return absl::OkStatus();
}

absl::Status CheckKeyMatchesLeaf(const TlsFiles& files, const X509* leaf, const EVP_PKEY* key) {
  const EVP_PKEY* leaf_key = X509_get0_pubkey(leaf);
  if (leaf_key == nullptr) {
    return SettingError(kCertSetting, absl::StrCat("'", files.cert, "': the public key of the certificate (subject ",
                                                   SubjectOf(leaf), ") cannot be read (", TakeOpenSslErrors(), ")"));
  }
  // 1: same key; 0: different keys; -1: different key types; -2: the types cannot be compared.
  const int same = EVP_PKEY_eq(leaf_key, key);
  ERR_clear_error();
  if (same == 1) return absl::OkStatus();
  std::string detail;
  if (same != 0) {
    detail = absl::StrCat("; the key is ", KeyTypeName(key), ", the certificate's key is ", KeyTypeName(leaf_key));
  }
  return SettingError(
      kKeySetting, absl::StrCat("the private key in '", files.key, "' does not match the certificate in 'tls_cert' ('",
                                files.cert, "', subject ", SubjectOf(leaf), ")", detail));
}

absl::Status ValidateTlsContents(const TlsFiles& files, const TlsFileContents& contents) {
  ELDR_ASSIGN_OR_RETURN(std::vector<X509Ptr> chain, ParseCertificates(kCertSetting, files.cert, contents.cert));
  const X509* leaf = chain.front().get();
  ELDR_RETURN_IF_ERROR(CheckValidityPeriod(files.cert, leaf));
  ELDR_ASSIGN_OR_RETURN(EvpPkeyPtr key, ParsePrivateKey(files.key, contents.key));
  ELDR_RETURN_IF_ERROR(CheckKeyMatchesLeaf(files, leaf, key.get()));
  if (!files.client_ca.empty()) {
    return ParseCertificates(kClientCaSetting, files.client_ca, contents.client_ca).status();
  }
  return absl::OkStatus();
}

// ---- The mirror folder ----

std::string ParentFolder(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Creates `path` and its missing parents (mode 0700) and opens it. The folder must be a directory
// (not a symlink) owned by this process's effective user.
absl::StatusOr<int> OpenMirrorFolder(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1)) {
    const std::string parent = path.substr(0, slash);
    if (::mkdir(parent.c_str(), 0700) != 0 && errno != EEXIST) return MirrorError(path, "create " + parent, errno);
  }
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) return MirrorError(path, "create", errno);
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      return absl::FailedPreconditionError(
          absl::StrCat("TLS mirror folder '", path, "' is not a directory (a symlink is not accepted)"));
    }
    return MirrorError(path, "open", errno);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return MirrorError(path, "stat", error);
  }
  if (st.st_uid != ::geteuid()) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("TLS mirror folder '", path, "' is owned by uid ", st.st_uid,
                                                      ", not by this process's user (uid ", ::geteuid(), ")"));
  }
  return fd;
}

// Mode 0700 on the mirror folder: only this user may list it or swap its links.
absl::Status MakeFolderPrivate(int dir_fd, const std::string& mirror_dir) {
  struct stat st {};
  if (::fstat(dir_fd, &st) != 0) return MirrorError(mirror_dir, "stat", errno);
  if ((st.st_mode & 07777) != 0700 && ::fchmod(dir_fd, 0700) != 0) return MirrorError(mirror_dir, "chmod 0700", errno);
  return absl::OkStatus();
}

// Removing every entry of ClearPreviousMirror would delete the operator's files if the mirror
// folder were the folder of the sources; this refuses that configuration.
absl::Status CheckNoSourceInFolder(const TlsFiles& source, int dir_fd, const std::string& mirror_dir) {
  struct stat folder {};
  if (::fstat(dir_fd, &folder) != 0) return MirrorError(mirror_dir, "stat", errno);
  const std::pair<const char*, const std::string*> settings[] = {
      {kCertSetting, &source.cert}, {kKeySetting, &source.key}, {kClientCaSetting, &source.client_ca}};
  for (const auto& [setting, path] : settings) {
    if (path->empty()) continue;
    std::vector<std::string> parents = {ParentFolder(*path)};
    if (char* resolved = ::realpath(path->c_str(), nullptr); resolved != nullptr) {
      parents.push_back(ParentFolder(resolved));
      std::free(resolved);
    }
    for (const std::string& parent : parents) {
      struct stat st {};
      if (::stat(parent.c_str(), &st) == 0 && st.st_dev == folder.st_dev && st.st_ino == folder.st_ino) {
        return SettingError(setting, absl::StrCat("'", *path, "' lies in the TLS mirror folder '", mirror_dir,
                                                  "'; the mirror needs a folder of its own"));
      }
    }
  }
  return absl::OkStatus();
}

bool IsSetFolderName(absl::string_view name) {
  uint64_t generation = 0;
  return absl::ConsumePrefix(&name, kSetPrefix) && !name.empty() &&
         std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
         absl::SimpleAtoi(name, &generation);
}

bool IsMirrorLinkName(absl::string_view name) {
  absl::ConsumeSuffix(&name, kTempSuffix);
  return name == kCurrentLinkName || name == kCertFileName || name == kKeyFileName || name == kClientCaFileName;
}

// Removes the set folder `name` (one level of files) in the folder `dir_fd`.
absl::Status RemoveSetFolder(int dir_fd, const std::string& mirror_dir, const std::string& name) {
  const int set_fd = ::openat(dir_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (set_fd < 0) {
    if (errno == ENOENT) return absl::OkStatus();
    if (errno == ENOTDIR || errno == ELOOP) {  // a stray file of that name
      if (::unlinkat(dir_fd, name.c_str(), 0) != 0) return MirrorError(mirror_dir, "remove " + name, errno);
      return absl::OkStatus();
    }
    return MirrorError(mirror_dir, "open " + name, errno);
  }
  DIR* listing = ::fdopendir(set_fd);  // owns set_fd from here on
  if (listing == nullptr) {
    const int error = errno;
    ::close(set_fd);
    return MirrorError(mirror_dir, "list " + name, error);
  }
  std::vector<std::string> entries;
  while (const dirent* entry = ::readdir(listing)) {
    const absl::string_view entry_name = entry->d_name;
    if (entry_name != "." && entry_name != "..") entries.emplace_back(entry_name);
  }
  absl::Status status;
  for (const std::string& entry : entries) {
    if (::unlinkat(::dirfd(listing), entry.c_str(), 0) != 0 && status.ok()) {
      status = MirrorError(mirror_dir, absl::StrCat("remove ", name, "/", entry), errno);
    }
  }
  ::closedir(listing);
  if (::unlinkat(dir_fd, name.c_str(), AT_REMOVEDIR) != 0 && status.ok()) {
    status = MirrorError(mirror_dir, "remove " + name, errno);
  }
  return status;
}

// Removes what an earlier mirror left in the folder: its set folders, links and temporary links.
absl::Status ClearPreviousMirror(int dir_fd, const std::string& mirror_dir) {
  const int listing_fd = ::dup(dir_fd);
  if (listing_fd < 0) return MirrorError(mirror_dir, "dup", errno);
  DIR* listing = ::fdopendir(listing_fd);
  if (listing == nullptr) {
    const int error = errno;
    ::close(listing_fd);
    return MirrorError(mirror_dir, "list", error);
  }
  ::rewinddir(listing);
  std::vector<std::string> sets;
  std::vector<std::string> links;
  while (const dirent* entry = ::readdir(listing)) {
    const std::string name = entry->d_name;
    if (IsSetFolderName(name)) sets.push_back(name);
    if (IsMirrorLinkName(name)) links.push_back(name);
  }
  ::closedir(listing);
  for (const std::string& link : links) {
    if (::unlinkat(dir_fd, link.c_str(), 0) != 0 && errno != ENOENT) {
      return MirrorError(mirror_dir, "remove " + link, errno);
    }
  }
  for (const std::string& set : sets) ELDR_RETURN_IF_ERROR(RemoveSetFolder(dir_fd, mirror_dir, set));
  return absl::OkStatus();
}

// Writes `bytes` as the new file `name` in the folder `folder_fd`, mode 0600, modification time
// `mtime` (whole seconds).
absl::Status WriteMirrorFile(int folder_fd, const std::string& mirror_dir, const std::string& name,
                             const std::string& bytes, std::time_t mtime) {
  const ScopedFd fd(::openat(folder_fd, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return MirrorError(mirror_dir, "create " + name, errno);
  // The umask can only clear bits of 0600; fchmod states the mode instead of relying on it.
  if (::fchmod(fd.get(), 0600) != 0) return MirrorError(mirror_dir, "chmod " + name, errno);
  if (absl::Status written = WriteAll(fd.get(), bytes); !written.ok()) {
    return absl::Status(written.code(),
                        absl::StrCat("TLS mirror folder '", mirror_dir, "': ", name, ": ", written.message()));
  }
  const timespec times[2] = {{0, UTIME_OMIT}, {mtime, 0}};  // access time left alone
  if (::futimens(fd.get(), times) != 0) return MirrorError(mirror_dir, "set the modification time of " + name, errno);
  return absl::OkStatus();
}

// Points the symlink `link` at `target`: a temporary link renamed over it, so that the name
// always resolves to either the old or the new target.
absl::Status ReplaceSymlink(int dir_fd, const std::string& mirror_dir, const std::string& link,
                            const std::string& target) {
  const std::string temp = link + kTempSuffix;
  if (::unlinkat(dir_fd, temp.c_str(), 0) != 0 && errno != ENOENT) {
    return MirrorError(mirror_dir, "remove " + temp, errno);
  }
  if (::symlinkat(target.c_str(), dir_fd, temp.c_str()) != 0) return MirrorError(mirror_dir, "create " + temp, errno);
  if (::renameat(dir_fd, temp.c_str(), dir_fd, link.c_str()) != 0) {
    const int error = errno;
    ::unlinkat(dir_fd, temp.c_str(), 0);
    return MirrorError(mirror_dir, absl::StrCat("rename ", temp, " to ", link), error);
  }
  return absl::OkStatus();
}

std::string WithoutTrailingSlashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

TlsFiles MirroredPaths(const std::string& mirror_dir, const TlsFiles& source) {
  const std::string prefix = mirror_dir == "/" ? mirror_dir : mirror_dir + "/";
  TlsFiles paths;
  paths.cert = prefix + kCertFileName;
  paths.key = prefix + kKeyFileName;
  if (!source.client_ca.empty()) paths.client_ca = prefix + kClientCaFileName;
  return paths;
}

}  // namespace

absl::Status ValidateTlsFiles(const TlsFiles& files) {
  OpenSslErrorScope errors;
  ELDR_ASSIGN_OR_RETURN(const TlsFileContents contents, ReadTlsContents(files));
  return ValidateTlsContents(files, contents);
}

TlsFileMirror::TlsFileMirror(TlsFiles source, std::string mirror_dir, int dir_fd)
    : source_(std::move(source)),
      mirror_dir_(std::move(mirror_dir)),
      mirrored_(MirroredPaths(mirror_dir_, source_)),
      dir_fd_(dir_fd) {}

TlsFileMirror::~TlsFileMirror() { ::close(dir_fd_); }

absl::StatusOr<std::unique_ptr<TlsFileMirror>> TlsFileMirror::Create(TlsFiles source, std::string mirror_dir) {
  OpenSslErrorScope errors;
  ELDR_ASSIGN_OR_RETURN(const TlsFileContents contents, ReadTlsContents(source));
  ELDR_RETURN_IF_ERROR(ValidateTlsContents(source, contents));
  if (mirror_dir.empty()) return absl::InvalidArgumentError("TLS mirror folder: no path given");
  mirror_dir = WithoutTrailingSlashes(std::move(mirror_dir));
  ELDR_ASSIGN_OR_RETURN(const int dir_fd, OpenMirrorFolder(mirror_dir));
  // From here on the mirror owns dir_fd.
  std::unique_ptr<TlsFileMirror> mirror(new TlsFileMirror(std::move(source), std::move(mirror_dir), dir_fd));
  // Checked before anything in the folder changes, its mode included.
  ELDR_RETURN_IF_ERROR(CheckNoSourceInFolder(mirror->source_, dir_fd, mirror->mirror_dir_));
  ELDR_RETURN_IF_ERROR(MakeFolderPrivate(dir_fd, mirror->mirror_dir_));
  ELDR_RETURN_IF_ERROR(ClearPreviousMirror(dir_fd, mirror->mirror_dir_));
  {
    absl::MutexLock lock(&mirror->mu_);
    ELDR_RETURN_IF_ERROR(mirror->Install(contents));
  }
  ELDR_RETURN_IF_ERROR(mirror->LinkStablePaths());
  return mirror;
}

absl::StatusOr<bool> TlsFileMirror::Refresh() {
  OpenSslErrorScope errors;
  absl::MutexLock lock(&mu_);
  ELDR_ASSIGN_OR_RETURN(const TlsFileContents contents, ReadTlsContents(source_));
  if (contents.digest == installed_digest_) return false;
  ELDR_RETURN_IF_ERROR(ValidateTlsContents(source_, contents));
  ELDR_RETURN_IF_ERROR(Install(contents));
  return true;
}

absl::Status TlsFileMirror::Install(const TlsFileContents& contents) {
  const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
  const std::string set_name = absl::StrCat(kSetPrefix, generation);
  // Strictly later than the previous set's time (see the header): the watcher's only defence
  // against reading the key of one set and the certificate of the next.
  const std::time_t mtime = std::max(std::time(nullptr), installed_mtime_ + 1);

  // A folder of that name can only be a leftover of something else; it is not ours to keep.
  ELDR_RETURN_IF_ERROR(RemoveSetFolder(dir_fd_, mirror_dir_, set_name));
  if (::mkdirat(dir_fd_, set_name.c_str(), 0700) != 0) return MirrorError(mirror_dir_, "create " + set_name, errno);
  absl::Status written = [&]() -> absl::Status {
    const ScopedFd set_folder(::openat(dir_fd_, set_name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!set_folder.valid()) return MirrorError(mirror_dir_, "open " + set_name, errno);
    const int set_fd = set_folder.get();
    if (::fchmod(set_fd, 0700) != 0) return MirrorError(mirror_dir_, "chmod " + set_name, errno);
    ELDR_RETURN_IF_ERROR(WriteMirrorFile(set_fd, mirror_dir_, kCertFileName, contents.cert, mtime));
    ELDR_RETURN_IF_ERROR(WriteMirrorFile(set_fd, mirror_dir_, kKeyFileName, contents.key, mtime));
    if (!mirrored_.client_ca.empty()) {
      ELDR_RETURN_IF_ERROR(WriteMirrorFile(set_fd, mirror_dir_, kClientCaFileName, contents.client_ca, mtime));
    }
    // The commit point: before this rename nothing a reader can reach has changed.
    return ReplaceSymlink(dir_fd_, mirror_dir_, kCurrentLinkName, set_name);
  }();
  if (!written.ok()) {
    RemoveSetFolder(dir_fd_, mirror_dir_, set_name).IgnoreError();  // the set in service is untouched
    return written;
  }
  installed_digest_ = contents.digest;
  installed_mtime_ = mtime;
  kept_sets_.push_back(set_name);
  while (kept_sets_.size() > kSetsKept) {
    // A set that cannot be removed only costs disk space until the next Create clears it.
    RemoveSetFolder(dir_fd_, mirror_dir_, kept_sets_.front()).IgnoreError();
    kept_sets_.pop_front();
  }
  generation_.store(generation, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status TlsFileMirror::LinkStablePaths() {
  std::vector<std::string> names = {kCertFileName, kKeyFileName};
  if (!mirrored_.client_ca.empty()) names.push_back(kClientCaFileName);
  for (const std::string& name : names) {
    ELDR_RETURN_IF_ERROR(ReplaceSymlink(dir_fd_, mirror_dir_, name, absl::StrCat(kCurrentLinkName, "/", name)));
  }
  return absl::OkStatus();
}

}  // namespace eldr::server
