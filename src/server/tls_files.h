// The server's TLS files (--tls_cert, --tls_key, --tls_client_ca): validation, and a private
// mirror of them that is the only thing gRPC's certificate watcher ever reads.
//
// Why both exist: gRPC 1.51's FileWatcherCertificateProvider hands whatever it reads to the TLS
// stack without checking it. A certificate and key that do not belong together (or a file that
// is not PEM at all) make the server's handshaker factory fail to build; the server still starts,
// health still says SERVING, and every new TLS connection is closed during the handshake. When the
// watched files are later rotated to such a set, the working pair is dropped too: new connections
// fail until the files are fixed (connections already open keep working). ValidateTlsFiles
// catches such a set before gRPC sees it; TlsFileMirror makes sure gRPC only ever watches copies
// that passed that check.
//
// Usage (startup, then a periodic refresh):
//   ELDR_ASSIGN_OR_RETURN(auto mirror, TlsFileMirror::Create({cert, key, client_ca}, dir));
//   const TlsFiles watched = mirror->mirrored();
//   FileWatcherCertificateProvider provider(watched.key, watched.cert, watched.client_ca, ...);
//   ...
//   absl::StatusOr<bool> changed = mirror->Refresh();  // every reload interval
//   // changed.ok() && *changed: a new set is installed (log, count); gRPC picks it up on its
//   // next poll. !changed.ok(): the rotation was refused (log, count); the old set stays.
#ifndef ELDR_SERVER_TLS_FILES_H_
#define ELDR_SERVER_TLS_FILES_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <deque>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace eldr::server {

// The largest TLS file read (certificate chain, key or CA bundle). Real chains and bundles are a
// few KiB to a few hundred KiB; the limit keeps a wrong path (a log file, a device) from being
// read into memory.
inline constexpr size_t kMaxTlsFileBytes = size_t{1} << 20;  // 1 MiB

// The bytes of one set of TLS files as read from their sources (defined in tls_files.cc).
struct TlsFileContents;

// Paths of one set of TLS files.
struct TlsFiles {
  std::string cert;       // PEM certificate chain, leaf first (setting tls_cert)
  std::string key;        // PEM private key of the leaf (setting tls_key)
  std::string client_ca;  // PEM bundle of client CAs (setting tls_client_ca); empty: no mutual TLS
};

// Checks that `files` make a set the TLS stack can serve, reading each file once:
//  - every path names a regular file (symlinks followed) of 1 byte .. kMaxTlsFileBytes; anything
//    else (a directory, a device such as /dev/zero, a FIFO) is refused without being read;
//  - tls_cert holds at least one PEM certificate and every certificate block in it parses;
//    blocks of other types are ignored, as gRPC ignores them. The first certificate is the leaf;
//  - the leaf is inside its validity period now: an expired certificate is an error, and so is one
//    that is not yet valid (clients would refuse both);
//  - tls_key holds a private key OpenSSL reads (RSA, EC, Ed25519, ...; PKCS#8 or traditional
//    PEM). An encrypted key is an error that says so: gRPC has no way to get a passphrase;
//  - the key is the leaf certificate's key;
//  - when client_ca is set, it holds at least one PEM certificate and every certificate block in
//    it parses.
// Returns OK, or INVALID_ARGUMENT whose message starts with "setting '<tls_cert|tls_key|
// tls_client_ca>': ", names the file, and says what is wrong, e.g. "setting 'tls_key': the
// private key in '/etc/tls/key.pem' does not match the certificate in 'tls_cert'
// ('/etc/tls/cert.pem', subject CN=router.example)". Messages never contain key material; they may
// contain certificate subjects and validity dates, which are public. Neither cert nor key may be
// empty.
//
// Thread-safe. Uses only the calling thread's OpenSSL error queue, which it leaves empty.
absl::Status ValidateTlsFiles(const TlsFiles& files);

// Private copies of a validated set of TLS files, for gRPC's FileWatcherCertificateProvider.
// A copy is only ever replaced by another validated set, so a broken rotation of the operator's
// files never reaches gRPC: the set in service stays until a valid one replaces it.
//
// Layout of the mirror folder (the folder belongs to this mirror; one mirror per folder):
//   tls_cert.pem      -> current/tls_cert.pem     the paths mirrored() returns; created once
//   tls_key.pem       -> current/tls_key.pem
//   tls_client_ca.pem -> current/tls_client_ca.pem (only with mutual TLS)
//   current           -> set-<generation>          swapped by one rename(2) per installed set
//   set-<generation>/                              mode 0700; files mode 0600, byte copies of the
//                                                  sources; the current and the previous set are
//                                                  kept, older ones removed
//
// What a reader of the mirrored paths sees. gRPC 1.51's watcher polls every refresh interval:
// it reads the client CA file; then, for key and certificate, it stat()s key and cert, reads the
// key, reads the cert, stat()s both again, and keeps the pair only if each file's modification
// time (whole seconds) is unchanged, retrying up to 3 times; when all 3 fail it reports an error,
// which the server logs while it keeps serving the pair it has, until the next poll. Against that
// reader:
//  - every open() of a mirrored path yields one complete file of one installed set: set files are
//    written before `current` names their set and never change afterwards;
//  - all files of a set share one modification time, and each installed set's time is later than
//    the previous set's by at least one second (max(now, previous + 1 s), so a burst of rotations
//    can put it a few seconds ahead of the clock). A read of the key from one set and of the
//    certificate from a later set therefore always shows the key's modification time changing
//    between the watcher's two stat()s, and the watcher discards that pair and retries. The key
//    is read first and sets only move forward, so the opposite mix cannot happen: the watcher
//    never installs a key and a certificate from different sets;
//  - the client CA bundle is read apart from the pair and may for one poll come from the set
//    after (or before) the pair's; both sets are valid, so that mix is harmless;
//  - a reader that spans two installs may find a file of a removed set gone (ENOENT); the watcher
//    counts that as a failed attempt and retries.
// Nothing is fsync()ed: the mirror is rebuilt from the sources by every Create, so what survives
// a crash does not matter, and rename(2) alone gives readers the atomicity above.
//
// A source rotation that replaces the files one at a time (`cp new.crt cert; cp new.key key`)
// can be seen half done: that Refresh refuses the mismatched set and a later one installs the
// completed set. Rotations that swap the files at once (a Kubernetes Secret volume, a rename of a
// folder symlink) never show that.
//
// The destructor closes the folder and leaves the installed set in place, so a certificate
// provider that outlives the mirror keeps reading a valid set; the next Create on the folder
// clears it.
//
// Thread-safety: Refresh may be called from any thread, concurrently with itself (calls are
// serialized) and with mirrored() and generation(), which never block.
class TlsFileMirror {
 public:
  // Validates the set named by `source` (as ValidateTlsFiles), then installs copies of exactly the
  // bytes validated in `mirror_dir` as generation 1. `mirror_dir` and missing parents are created
  // with mode 0700; an existing folder must be a directory (not a symlink) owned by this process's
  // effective user, and gets mode 0700. Entries a previous mirror left there (the names above) are
  // removed; other entries are left alone. The folder must not be the one holding a source file.
  // Errors: the validation error (INVALID_ARGUMENT) when the source set is not valid;
  // INVALID_ARGUMENT when `mirror_dir` is empty or holds a source file; FAILED_PRECONDITION when
  // the folder is not usable (wrong type or owner); the errno's code for a failed file operation.
  static absl::StatusOr<std::unique_ptr<TlsFileMirror>> Create(TlsFiles source, std::string mirror_dir);

  ~TlsFileMirror();
  TlsFileMirror(const TlsFileMirror&) = delete;
  TlsFileMirror& operator=(const TlsFileMirror&) = delete;

  // Paths of the copies, to hand to FileWatcherCertificateProvider; client_ca is empty when the
  // source has none. Constant for the mirror's lifetime.
  TlsFiles mirrored() const { return mirrored_; }

  // The paths this mirror copies from (as given to Create).
  const TlsFiles& source() const { return source_; }

  // Number of sets installed so far: 1 after Create, +1 for every Refresh that returned true.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  // Re-reads the source files and compares them with the installed set (SHA-256 of each file):
  //  - same contents: returns false, touches nothing. An installed set is not judged again (an
  //    installed certificate that has since expired stays: removing it would serve nothing);
  //  - changed and valid: installs the new set (a new generation; layout and guarantees above)
  //    and returns true;
  //  - changed and not valid, or a source file unreadable: returns the validation error
  //    (INVALID_ARGUMENT, as ValidateTlsFiles) and leaves the installed set untouched, byte for
  //    byte. The set is judged again on every call, so the error repeats until the source is fixed
  //    (callers that log should log changes of the message), and a not-yet-valid certificate is
  //    installed by the first Refresh after its start date;
  //  - the new set could not be written (disk full, ...): returns the errno's status; the installed
  //    set is still in service and the partial copy is removed.
  absl::StatusOr<bool> Refresh();

 private:
  TlsFileMirror(TlsFiles source, std::string mirror_dir, int dir_fd);

  // Writes `contents` as the next set and makes `current` name it.
  absl::Status Install(const TlsFileContents& contents) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Creates the mirrored() symlinks (once, after the first Install).
  absl::Status LinkStablePaths();

  const TlsFiles source_;
  const std::string mirror_dir_;
  const TlsFiles mirrored_;
  const int dir_fd_;  // the mirror folder, open for the mirror's lifetime

  absl::Mutex mu_;                                          // serializes Refresh
  std::string installed_digest_ ABSL_GUARDED_BY(mu_);       // SHA-256 of cert, key and client CA
  std::time_t installed_mtime_ ABSL_GUARDED_BY(mu_) = 0;    // modification time of the set's files
  std::deque<std::string> kept_sets_ ABSL_GUARDED_BY(mu_);  // folder names, oldest first
  std::atomic<uint64_t> generation_{0};
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_TLS_FILES_H_
