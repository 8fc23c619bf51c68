// Process setup shared by ELDR's network daemons and tools that hold many connections
// (eldr-proxy, eldr-engine-emu, eldr-loadgen): stop signals delivered to one waiting thread,
// SIGPIPE ignored, the descriptor limit raised. (eldr-router handles its signals itself: it also
// reloads on SIGHUP.)
//
// Thread-safety: call BlockStopSignals from main before any thread starts; WaitForStopSignal
// from the main thread.
#ifndef ELDR_COMMON_DAEMON_H_
#define ELDR_COMMON_DAEMON_H_

#include <signal.h>

namespace eldr {

// Blocks SIGTERM and SIGINT in the calling thread, and so in every thread it starts afterwards
// (they are then received by WaitForStopSignal only, never by a random thread mid-call), and
// ignores SIGPIPE (a peer that closed its connection costs an error code, never the process).
// Returns the blocked set, for WaitForStopSignal.
sigset_t BlockStopSignals();

// Waits until SIGTERM or SIGINT arrives; returns its number.
int WaitForStopSignal(const sigset_t& signals);

// Raises the soft limit on open descriptors to the hard one (thousands of concurrent streams need
// as many sockets; the soft limit is often 1024). Best effort: failures change nothing.
void RaiseOpenFilesLimit();

}  // namespace eldr

#endif  // ELDR_COMMON_DAEMON_H_
