// dtorch_core._native's shared-memory channel (its design: native/shm_channel.cpp): the shared
// layout, the errors, the wait primitives and the ShmChannel class; its public methods and the
// module are in shm_channel.cpp, the segment, the ring and the waits in shm_ring.cpp.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace dtorch_shm {

constexpr uint32_t kMagic = 0x48435444u;  // "DTCH"
constexpr uint32_t kLayoutVersion = 3;
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kFrameHeader = 8;
constexpr uint64_t kMinCapacity = 4096;
constexpr uint64_t kMaxCapacity = 1ull << 40;
constexpr uint64_t kMaxMessage = 1ull << 47;
// Messages up to this size are copied with the GIL held (cheaper than releasing it).
constexpr uint64_t kGilCopyLimit = 64 * 1024;
// While blocked: how often to check that the peer is alive and to run Python signal handlers.
constexpr int64_t kCheckIntervalNs = 50'000'000;
// How often a send that does not block checks that the reader is alive.
constexpr int64_t kSendCheckIntervalNs = 100'000'000;

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be plain 32-bit");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "positions must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words must be 4 bytes");

struct alignas(64) Side {
  std::atomic<uint64_t> pos;       // writer: bytes published; reader: bytes consumed
  std::atomic<uint64_t> wake_pos;  // while waiting: wake me once the other side's pos >= this
  std::atomic<uint32_t> seq;       // futex word bumped by this side when the other side waits
  std::atomic<uint32_t> waiting;   // 1 while this side sleeps (or is about to) on the other's seq
  std::atomic<uint32_t> closed;    // 1 once this side called close()
  std::atomic<int32_t> pid;        // process holding this side (0: not opened yet)
  // reader line only: 1 while the reader has taken every message and its device has run dry
  // (set by the reader, cleared by the writer's next send and the reader's next take); the
  // controller reads it to send what it holds at once instead of waiting for a fuller batch
  std::atomic<uint32_t> hungry;
};

struct Header {
  uint32_t magic;
  uint32_t version;
  uint64_t capacity;
  alignas(64) Side writer;
  alignas(64) Side reader;
};
static_assert(sizeof(Header) <= kHeaderBytes, "header must fit in its page");

// C++ errors turned into Python exceptions by the translator registered in the module.
struct ClosedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct TimeoutErr : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct OsError : std::runtime_error {
  int code;
  OsError(int c, const std::string& what) : std::runtime_error(what), code(c) {}
};
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The peer wrote an impossible position or length: this end is closed (a ClosedError too).
struct CorruptError : ClosedError {
  using ClosedError::ClosedError;
};
// A message over this end's max_message was given to send(): nothing was written.
struct TooLargeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The thread CPython delivers signals on (PyErr_CheckSignals does nothing on any other), set
// at import from threading.main_thread(): a wait off that thread never takes the GIL to check.
inline unsigned long g_main_thread = 0;
inline bool on_signal_thread() { return g_main_thread == 0 || PyThread_get_thread_ident() == g_main_thread; }
inline PyObject* g_closed_type = nullptr;   // dtorch_core.transport.channel.ChannelClosedError
inline PyObject* g_timeout_type = nullptr;  // dtorch_core.transport.channel.ChannelTimeoutError
inline PyObject* g_corrupt_type = nullptr;  // dtorch_core.transport.base.ChannelCorruptError
inline PyObject* g_too_large_type = nullptr;  // dtorch_core.transport.base.ChannelMessageTooLargeError

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{time_t(timeout_ns / 1'000'000'000), long(timeout_ns % 1'000'000'000)};
  // Shared (not FUTEX_PRIVATE) futex: the word lives in a mapping shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline int64_t deadline_from(const std::optional<double>& timeout) {
  if (!timeout) return -1;
  double t = *timeout;
  if (std::isnan(t)) throw UsageError("timeout must be a number of seconds or None");
  if (t <= 0) return now_ns();
  if (t > 1e9) return -1;  // effectively forever
  return now_ns() + int64_t(t * 1e9);
}

inline std::string seconds(const std::optional<double>& timeout) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", timeout ? *timeout : 0.0);
  return buf;
}

// True when `pid` has exited (zombie or gone); used only where pidfd_open is unavailable.
inline bool pid_gone_fallback(int pid) {
  if (kill(pid, 0) == -1 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return errno == ENOENT;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');
  if (!close_paren || close_paren[1] == 0) return false;
  char state = close_paren[2];
  return state == 'Z' || state == 'X';
}

// Holds a Py_buffer; released in the destructor, which always runs with the GIL held because it
// is declared outside every gil_scoped_release.
struct BufferGuard {
  Py_buffer view{};
  bool held = false;
  ~BufferGuard() {
    if (held) PyBuffer_Release(&view);
  }
};

class ShmChannel {
 public:
  ShmChannel(const std::string& name, const std::string& role, bool create, uint64_t capacity,
             double spin_us, uint64_t max_message);

  ~ShmChannel();

  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // ------------------------------------------------------------------------------------------
  // send
  // ------------------------------------------------------------------------------------------
  void send(nb::handle data, std::optional<double> timeout);

  // ------------------------------------------------------------------------------------------
  // receive
  // ------------------------------------------------------------------------------------------
  nb::object recv(std::optional<double> timeout);

  nb::object try_recv();

  // ------------------------------------------------------------------------------------------
  // lifecycle
  // ------------------------------------------------------------------------------------------
  void close();

  void expect_peer(int pid) { expected_peer_pid_.store(pid, std::memory_order_relaxed); }

  bool closed() const { return closed_.load(std::memory_order_acquire); }
  const std::string& name() const { return name_; }
  uint64_t capacity() const { return cap_; }
  uint64_t max_message() const { return max_message_; }
  std::string role() const { return writer_ ? "send" : "recv"; }

  // Bytes published and not yet consumed (a diagnostic; racy by nature).
  uint64_t pending();

  // Reader: say that this end has taken everything and its device has run dry (see Side::hungry).
  void set_hungry();
  // Writer: whether the reader said so since the last send; and the address of that word, for
  // the controller's native hot path (valid until this end is closed).
  bool peer_hungry();
  uintptr_t hungry_word();

 private:
  // ------------------------------------------------------------------------------------------
  // setup and teardown
  // ------------------------------------------------------------------------------------------
  void create_segment(uint64_t capacity);

  void open_segment();

  void map(int fd, size_t len);

  void unmap();

  // Raise the shared closed flag and wake everyone who might sleep on this channel (the peer on
  // our word, and any thread of ours on the peer's word). Safe without the mutex.
  void mark_closed();

  void release_resources();

  // ------------------------------------------------------------------------------------------
  // ring arithmetic (call with the mutex held)
  // ------------------------------------------------------------------------------------------
  Side& self() { return writer_ ? hdr_->writer : hdr_->reader; }
  Side& peer() { return writer_ ? hdr_->reader : hdr_->writer; }

  // Writer: free bytes, re-reading the reader's position only when the cached one says < need.
  // The reader's position must lie in [my_pos_ - cap_, my_pos_]: anything else is corrupt.
  uint64_t free_space(uint64_t need);

  // Reader: published bytes not yet consumed, re-reading the writer's position only if needed.
  // The writer's position must lie in [my_pos_, my_pos_ + cap_]: anything else is corrupt.
  uint64_t available(uint64_t need);

  // The peer's position is impossible: close this end (so nothing more is copied) and raise.
  [[noreturn]] void corrupt_position(uint64_t p);

  void copy_in(uint64_t pos, const uint8_t* src, uint64_t n);

  void copy_out(uint64_t pos, uint8_t* dst, uint64_t n) const;

  // Publish my position and wake the peer if (and only if) it sleeps and my position reached
  // the one it waits for.
  void publish();

  void write_frame(const uint8_t* src, uint64_t n);

  uint64_t read_length();

  // ------------------------------------------------------------------------------------------
  // waiting
  // ------------------------------------------------------------------------------------------
  void ensure_open_locked();

  // The checks a writer makes: the reader closed or (now and then) its process is gone.
  void send_checks(bool force);

  void check_peer_alive(const char* what);

  [[noreturn]] void peer_gone(int pid, const char* what);

  // Wait until `need` bytes can be written (writer) or read (reader). `deadline` < 0 waits
  // forever. `interruptible` (only before any byte of a message moved) allows the timeout and
  // Python signal handlers to end the wait. Closed or dead peers always end it. Call with the
  // mutex held and the GIL released.
  void wait_for(uint64_t need, int64_t deadline, bool interruptible,
                const std::optional<double>& timeout, const char* what);

  // Writer, mutex held, GIL released.
  void send_slow(const uint8_t* src, uint64_t n, int64_t deadline,
                 const std::optional<double>& timeout);

  // Reader, mutex and GIL held: a complete small message, or null.
  nb::object take_small();

  // Reader, mutex and GIL held, a frame header of length n at my_pos_: read the whole message.
  nb::object take_body(uint64_t n);

  std::string name_;
  bool creator_ = false;
  bool writer_ = false;
  bool unlinked_ = false;
  Header* hdr_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t map_len_ = 0;
  uint64_t cap_ = 0;
  uint64_t mask_ = 0;
  uint64_t max_message_ = kMaxMessage;  // longest message either way (both ends check it)
  uint64_t my_pos_ = 0;    // my side's position (only this endpoint writes it)
  uint64_t peer_pos_ = 0;  // last seen position of the other side
  int64_t spin_max_ns_ = 0;  // spin budget limit (DTORCH_CHANNEL_SPIN_US)
  int64_t spin_ns_ = 0;      // current adaptive spin budget
  unsigned spin_probe_ = 0;
  int64_t next_send_check_ = 0;
  int peer_pid_ = 0;
  int peer_pidfd_ = -1;
  std::atomic<int> expected_peer_pid_{0};
  std::atomic<bool> closed_{false};
  std::mutex mu_;
};

}  // namespace dtorch_shm
