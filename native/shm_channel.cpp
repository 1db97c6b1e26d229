// dtorch_core._native: the hot path of the local transport.
//
// ShmChannel is one end of a one-direction byte-message channel between two processes on this
// host: a single-producer single-consumer ring in POSIX shared memory (shm_open + mmap).
//
// Layout of the shared object (one page of header, then the ring):
//
//   page 0   Header: magic, layout version, capacity, then one cache line per side:
//              writer line: write position, wake position, "data" futex word, waiting flag,
//                           closed flag, pid
//              reader line: read position, wake position, "space" futex word, waiting flag,
//                           closed flag, pid
//   page 1.. ring of `capacity` bytes (a power of two)
//
// Positions are monotonic 64-bit byte counts (index = pos & (capacity - 1)), so "full" and
// "empty" never need a spare slot. The ring is a byte stream of frames: an 8-byte little-endian
// length, then the payload; either may wrap around the end of the ring (copies are split in two).
//
// A frame that fits in the ring is written whole and published with one store, so the reader sees
// either nothing or the complete message. A larger frame is streamed: the writer publishes it in
// pieces of at least a quarter ring and the reader consumes them as they arrive (copying straight
// into the result bytes object), so messages of any size pass through a small ring.
//
// Waiting: a short adaptive spin (at most 50 us by default; less while spinning does not pay),
// then the waiter publishes the other side's position it needs (wake position), raises its
// waiting flag and sleeps on the other side's futex word (FUTEX_WAIT on the shared mapping). The
// other side bumps that word and calls FUTEX_WAKE only when the flag is up and its position has
// reached the wake position, so an uncontended send or receive makes no system call. A writer that
// finds the ring full waits for a quarter of it to drain, so a producer ahead of its consumer
// sleeps once per quarter ring instead of once per message. Sleeps are cut into 50 ms slices;
// between slices the waiter checks the peer's closed flag, whether the peer process is still alive
// (pidfd, or /proc as a fallback) and Python signals, so a reader never waits forever for a writer
// that is gone. The GIL is released while waiting and while copying large messages.
//
// The peer is not trusted: every position and length read from the shared header is checked
// against the capacity before it is used (a writer position more than `capacity` ahead of the
// reader's, a reader position ahead of the writer's or a frame length over the end's
// max_message), and a bad one closes this end with ChannelCorruptError instead of letting a copy
// run past the mapping. Both ends refuse messages over max_message (DTORCH_MAX_MESSAGE_BYTES):
// the sender before anything is written (ChannelMessageTooLargeError, the channel stays usable),
// the receiver before it allocates (ChannelCorruptError: the stream cannot go on).
//
// Each endpoint is guarded by a mutex (several Python threads may share one end). Lock order:
// endpoint mutex, then GIL; nobody blocks on the mutex while holding the GIL.

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

namespace {

constexpr uint32_t kMagic = 0x48435444u;  // "DTCH"
constexpr uint32_t kLayoutVersion = 2;
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

PyObject* g_closed_type = nullptr;   // dtorch_core.transport.channel.ChannelClosedError
PyObject* g_timeout_type = nullptr;  // dtorch_core.transport.channel.ChannelTimeoutError
PyObject* g_corrupt_type = nullptr;  // dtorch_core.transport.base.ChannelCorruptError
PyObject* g_too_large_type = nullptr;  // dtorch_core.transport.base.ChannelMessageTooLargeError

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

int64_t deadline_from(const std::optional<double>& timeout) {
  if (!timeout) return -1;
  double t = *timeout;
  if (std::isnan(t)) throw UsageError("timeout must be a number of seconds or None");
  if (t <= 0) return now_ns();
  if (t > 1e9) return -1;  // effectively forever
  return now_ns() + int64_t(t * 1e9);
}

std::string seconds(const std::optional<double>& timeout) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", timeout ? *timeout : 0.0);
  return buf;
}

// True when `pid` has exited (zombie or gone); used only where pidfd_open is unavailable.
bool pid_gone_fallback(int pid) {
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
             double spin_us, uint64_t max_message)
      : name_(name), creator_(create) {
    max_message_ = (max_message == 0 || max_message > kMaxMessage) ? kMaxMessage : max_message;
    if (role == "send") {
      writer_ = true;
    } else if (role == "recv") {
      writer_ = false;
    } else {
      throw UsageError("role must be 'send' or 'recv', not '" + role + "'");
    }
    if (name.empty() || name[0] != '/' || name.find('/', 1) != std::string::npos ||
        name.size() > 250)
      throw UsageError("shared-memory name must look like '/name' (got '" + name + "')");
    spin_max_ns_ = spin_us > 0 ? int64_t(spin_us * 1000.0) : 0;
    spin_ns_ = spin_max_ns_;
    if (create)
      create_segment(capacity);
    else
      open_segment();
  }

  ~ShmChannel() {
    mark_closed();
    release_resources();
  }

  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // ------------------------------------------------------------------------------------------
  // send
  // ------------------------------------------------------------------------------------------
  void send(nb::handle data, std::optional<double> timeout) {
    if (!writer_) throw UsageError("this end of channel " + name_ + " receives; it cannot send");
    BufferGuard buf;
    if (PyObject_GetBuffer(data.ptr(), &buf.view, PyBUF_SIMPLE) != 0) throw nb::python_error();
    buf.held = true;
    const auto* src = static_cast<const uint8_t*>(buf.view.buf);
    const uint64_t n = uint64_t(buf.view.len);
    if (n > max_message_)
      throw TooLargeError("channel " + name_ + ": a message of " + std::to_string(n) +
                          " bytes is over the limit of " + std::to_string(max_message_) +
                          " bytes (DTORCH_MAX_MESSAGE_BYTES, at most 2^47); nothing was sent. "
                          "Send it in smaller pieces or raise the limit on both ends");
    const int64_t deadline = deadline_from(timeout);

    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (lk.owns_lock() && n <= kGilCopyLimit) {
      ensure_open_locked();
      if (free_space(n + kFrameHeader) >= n + kFrameHeader) {
        send_checks(false);
        write_frame(src, n);
        return;
      }
    }
    {
      nb::gil_scoped_release release;
      if (!lk.owns_lock()) lk.lock();
      ensure_open_locked();
      send_checks(false);
      send_slow(src, n, deadline, timeout);
    }
  }

  // ------------------------------------------------------------------------------------------
  // receive
  // ------------------------------------------------------------------------------------------
  nb::object recv(std::optional<double> timeout) {
    if (writer_) throw UsageError("this end of channel " + name_ + " sends; it cannot receive");
    const int64_t deadline = deadline_from(timeout);
    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (lk.owns_lock()) {
      ensure_open_locked();
      if (nb::object small = take_small()) return small;
    }
    uint64_t n;
    {
      nb::gil_scoped_release release;
      if (!lk.owns_lock()) lk.lock();
      ensure_open_locked();
      wait_for(kFrameHeader, deadline, true, timeout, "a message");
      n = read_length();
    }
    return take_body(n);
  }

  nb::object try_recv() {
    if (writer_) throw UsageError("this end of channel " + name_ + " sends; it cannot receive");
    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      nb::gil_scoped_release release;
      lk.lock();
    }
    ensure_open_locked();
    if (nb::object small = take_small()) return small;
    if (available(kFrameHeader) >= kFrameHeader) return take_body(read_length());
    // Nothing there: report a writer that is gone, so polling loops learn about it too.
    if (peer().closed.load(std::memory_order_acquire))
      throw ClosedError("channel " + name_ + ": the writer closed it (no more messages)");
    int64_t t = now_ns();
    if (t >= next_send_check_) {
      next_send_check_ = t + kSendCheckIntervalNs;
      check_peer_alive("a message");
    }
    return nb::none();
  }

  // ------------------------------------------------------------------------------------------
  // lifecycle
  // ------------------------------------------------------------------------------------------
  void close() {
    mark_closed();
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lk(mu_);  // waits for an operation in flight to notice and leave
    release_resources();
  }

  void expect_peer(int pid) { expected_peer_pid_.store(pid, std::memory_order_relaxed); }

  bool closed() const { return closed_.load(std::memory_order_acquire); }
  const std::string& name() const { return name_; }
  uint64_t capacity() const { return cap_; }
  uint64_t max_message() const { return max_message_; }
  std::string role() const { return writer_ ? "send" : "recv"; }

  // Bytes published and not yet consumed (a diagnostic; racy by nature).
  uint64_t pending() {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lk(mu_);
    if (!hdr_) return 0;
    return hdr_->writer.pos.load(std::memory_order_acquire) -
           hdr_->reader.pos.load(std::memory_order_acquire);
  }

 private:
  // ------------------------------------------------------------------------------------------
  // setup and teardown
  // ------------------------------------------------------------------------------------------
  void create_segment(uint64_t capacity) {
    uint64_t cap = kMinCapacity;
    while (cap < capacity) cap <<= 1;
    if (cap > kMaxCapacity) throw UsageError("channel capacity too large");
    const size_t len = size_t(kHeaderBytes + cap);
    int fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) throw OsError(errno, "shm_open(" + name_ + ") failed: " + std::strerror(errno));
    if (ftruncate(fd, off_t(len)) != 0) {
      int e = errno;
      ::close(fd);
      shm_unlink(name_.c_str());
      throw OsError(e, "ftruncate of " + name_ + " failed: " + std::strerror(e));
    }
    // Reserve the pages now: a full /dev/shm then fails here with an error instead of SIGBUS on
    // first touch.
    int rc = posix_fallocate(fd, 0, off_t(len));
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
      ::close(fd);
      shm_unlink(name_.c_str());
      throw OsError(rc, "cannot reserve " + std::to_string(len) +
                            " bytes of shared memory (/dev/shm) for channel " + name_ + ": " +
                            std::strerror(rc) + "; free /dev/shm or use a smaller capacity");
    }
    map(fd, len);
    hdr_->version = kLayoutVersion;
    hdr_->capacity = cap;
    self().pid.store(int32_t(getpid()), std::memory_order_relaxed);
    __atomic_store_n(&hdr_->magic, kMagic, __ATOMIC_RELEASE);
    cap_ = cap;
    mask_ = cap - 1;
  }

  void open_segment() {
    int fd = shm_open(name_.c_str(), O_RDWR, 0);
    if (fd < 0)
      throw OsError(errno, "cannot open channel " + name_ + ": " + std::strerror(errno) +
                               " (the creating process must keep its end open until this one "
                               "has opened it)");
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int e = errno;
      ::close(fd);
      throw OsError(e, "fstat of " + name_ + " failed: " + std::strerror(e));
    }
    if (uint64_t(st.st_size) < kHeaderBytes + kMinCapacity) {
      ::close(fd);
      throw UsageError("shared-memory object " + name_ + " is not a dtorch channel (too small)");
    }
    map(fd, size_t(st.st_size));
    if (__atomic_load_n(&hdr_->magic, __ATOMIC_ACQUIRE) != kMagic ||
        hdr_->version != kLayoutVersion ||
        hdr_->capacity + kHeaderBytes != uint64_t(st.st_size) ||
        (hdr_->capacity & (hdr_->capacity - 1)) != 0) {
      unmap();
      throw UsageError("shared-memory object " + name_ +
                       " is not a dtorch channel of this version (layout " +
                       std::to_string(kLayoutVersion) + ")");
    }
    cap_ = hdr_->capacity;
    mask_ = cap_ - 1;
    int32_t expected = 0;
    if (!self().pid.compare_exchange_strong(expected, int32_t(getpid()))) {
      unmap();
      throw UsageError("channel " + name_ + ": its " + role() + " end is already open in process " +
                       std::to_string(expected));
    }
    // Both ends hold the mapping now: the name is no longer needed.
    shm_unlink(name_.c_str());
    unlinked_ = true;
    my_pos_ = self().pos.load(std::memory_order_acquire);
    peer_pos_ = peer().pos.load(std::memory_order_acquire);
    const uint64_t used = writer_ ? my_pos_ - peer_pos_ : peer_pos_ - my_pos_;
    if (used > cap_) {
      mark_closed();
      throw CorruptError("channel " + name_ + " is corrupt: its header holds a writer position " +
                         std::to_string(hdr_->writer.pos.load()) + " and a reader position " +
                         std::to_string(hdr_->reader.pos.load()) + " more than the capacity (" +
                         std::to_string(cap_) + " bytes) apart; make a new channel");
    }
  }

  void map(int fd, size_t len) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    int e = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      if (creator_) shm_unlink(name_.c_str());
      throw OsError(e, "mmap of " + name_ + " failed: " + std::strerror(e));
    }
    hdr_ = static_cast<Header*>(p);
    data_ = static_cast<uint8_t*>(p) + kHeaderBytes;
    map_len_ = len;
  }

  void unmap() {
    if (hdr_) munmap(hdr_, map_len_);
    hdr_ = nullptr;
    data_ = nullptr;
  }

  // Raise the shared closed flag and wake everyone who might sleep on this channel (the peer on
  // our word, and any thread of ours on the peer's word). Safe without the mutex.
  void mark_closed() {
    if (closed_.exchange(true, std::memory_order_acq_rel)) return;
    Header* h = hdr_;
    if (!h) return;
    Side& me = writer_ ? h->writer : h->reader;
    Side& other = writer_ ? h->reader : h->writer;
    me.closed.store(1, std::memory_order_release);
    me.seq.fetch_add(1, std::memory_order_acq_rel);
    futex_wake_all(&me.seq);
    other.seq.fetch_add(1, std::memory_order_acq_rel);  // spurious bump: waiters re-check
    futex_wake_all(&other.seq);
  }

  void release_resources() {
    unmap();
    if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
    peer_pidfd_ = -1;
    if (creator_ && !unlinked_) shm_unlink(name_.c_str());  // ENOENT once the opener unlinked it
    unlinked_ = true;
  }

  // ------------------------------------------------------------------------------------------
  // ring arithmetic (call with the mutex held)
  // ------------------------------------------------------------------------------------------
  Side& self() { return writer_ ? hdr_->writer : hdr_->reader; }
  Side& peer() { return writer_ ? hdr_->reader : hdr_->writer; }

  // Writer: free bytes, re-reading the reader's position only when the cached one says < need.
  // The reader's position must lie in [my_pos_ - cap_, my_pos_]: anything else is corrupt.
  uint64_t free_space(uint64_t need) {
    uint64_t f = cap_ - (my_pos_ - peer_pos_);
    if (f >= need) return f;
    const uint64_t p = peer().pos.load(std::memory_order_acquire);
    if (my_pos_ - p > cap_) corrupt_position(p);
    peer_pos_ = p;
    return cap_ - (my_pos_ - peer_pos_);
  }

  // Reader: published bytes not yet consumed, re-reading the writer's position only if needed.
  // The writer's position must lie in [my_pos_, my_pos_ + cap_]: anything else is corrupt.
  uint64_t available(uint64_t need) {
    uint64_t a = peer_pos_ - my_pos_;
    if (a >= need) return a;
    const uint64_t p = peer().pos.load(std::memory_order_acquire);
    if (p - my_pos_ > cap_) corrupt_position(p);
    peer_pos_ = p;
    return peer_pos_ - my_pos_;
  }

  // The peer's position is impossible: close this end (so nothing more is copied) and raise.
  [[noreturn]] void corrupt_position(uint64_t p) {
    mark_closed();
    throw CorruptError("channel " + name_ + " is corrupt: the " +
                       (writer_ ? "reader's position " : "writer's position ") +
                       std::to_string(p) + " is " + (writer_ ? "not within " : "more than ") +
                       std::to_string(cap_) + " bytes (the capacity) " +
                       (writer_ ? "behind this writer's " : "ahead of this reader's ") +
                       std::to_string(my_pos_) +
                       "; the other process is broken or hostile. This end is closed; make a "
                       "new channel");
  }

  void copy_in(uint64_t pos, const uint8_t* src, uint64_t n) {
    uint64_t off = pos & mask_;
    uint64_t first = std::min(n, cap_ - off);
    std::memcpy(data_ + off, src, first);
    if (n > first) std::memcpy(data_, src + first, n - first);
  }

  void copy_out(uint64_t pos, uint8_t* dst, uint64_t n) const {
    uint64_t off = pos & mask_;
    uint64_t first = std::min(n, cap_ - off);
    std::memcpy(dst, data_ + off, first);
    if (n > first) std::memcpy(dst + first, data_, n - first);
  }

  // Publish my position and wake the peer if (and only if) it sleeps and my position reached
  // the one it waits for.
  void publish() {
    Side& me = self();
    Side& other = peer();
    me.pos.store(my_pos_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (other.waiting.load(std::memory_order_acquire) &&
        my_pos_ >= other.wake_pos.load(std::memory_order_relaxed)) {
      me.seq.fetch_add(1, std::memory_order_release);
      futex_wake_all(&me.seq);
    }
  }

  void write_frame(const uint8_t* src, uint64_t n) {
    uint8_t header[kFrameHeader];
    for (int i = 0; i < 8; ++i) header[i] = uint8_t(n >> (8 * i));
    copy_in(my_pos_, header, kFrameHeader);
    copy_in(my_pos_ + kFrameHeader, src, n);
    my_pos_ += kFrameHeader + n;
    publish();
  }

  uint64_t read_length() {
    uint8_t header[kFrameHeader];
    copy_out(my_pos_, header, kFrameHeader);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(header[i]) << (8 * i);
    if (n > max_message_) {
      mark_closed();
      throw CorruptError("channel " + name_ + ": a frame claims " + std::to_string(n) +
                         " bytes, over the limit of " + std::to_string(max_message_) +
                         " bytes (DTORCH_MAX_MESSAGE_BYTES, at most 2^47); the stream cannot go "
                         "on, so this end is closed. Raise the limit on both ends if the "
                         "message is real, else the other process is broken");
    }
    return n;
  }

  // ------------------------------------------------------------------------------------------
  // waiting
  // ------------------------------------------------------------------------------------------
  void ensure_open_locked() {
    if (closed_.load(std::memory_order_acquire) || !hdr_)
      throw ClosedError("channel " + name_ + ": this end is closed");
  }

  // The checks a writer makes: the reader closed or (now and then) its process is gone.
  void send_checks(bool force) {
    if (peer().closed.load(std::memory_order_acquire))
      throw ClosedError("channel " + name_ + ": the reader closed it");
    int64_t t = now_ns();
    if (force || t >= next_send_check_) {
      next_send_check_ = t + kSendCheckIntervalNs;
      check_peer_alive("room");
    }
  }

  void check_peer_alive(const char* what) {
    int pid = peer().pid.load(std::memory_order_acquire);
    if (pid == 0) pid = expected_peer_pid_.load(std::memory_order_relaxed);
    if (pid <= 0 || pid == getpid()) return;
    if (pid != peer_pid_) {
      if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
      peer_pid_ = pid;
      peer_pidfd_ = int(syscall(SYS_pidfd_open, pid, 0));
      if (peer_pidfd_ < 0 && errno == ESRCH) peer_gone(pid, what);
    }
    bool gone;
    if (peer_pidfd_ >= 0) {
      pollfd p{peer_pidfd_, POLLIN, 0};
      gone = ::poll(&p, 1, 0) > 0;  // a pidfd turns readable when its process exits
    } else {
      gone = pid_gone_fallback(pid);
    }
    if (gone) peer_gone(pid, what);
  }

  [[noreturn]] void peer_gone(int pid, const char* what) {
    throw ClosedError("channel " + name_ + ": the " + (writer_ ? "reader" : "writer") +
                      " process " + std::to_string(pid) + " exited while waiting for " + what);
  }

  // Wait until `need` bytes can be written (writer) or read (reader). `deadline` < 0 waits
  // forever. `interruptible` (only before any byte of a message moved) allows the timeout and
  // Python signal handlers to end the wait. Closed or dead peers always end it. Call with the
  // mutex held and the GIL released.
  void wait_for(uint64_t need, int64_t deadline, bool interruptible,
                const std::optional<double>& timeout, const char* what) {
    auto ready = [&] { return (writer_ ? free_space(need) : available(need)) >= need; };
    if (ready()) return;
    // The other side's position at which `need` is met: it wakes us only once it gets there.
    const uint64_t wake_pos = writer_ ? (my_pos_ + need > cap_ ? my_pos_ + need - cap_ : 0)
                                      : my_pos_ + need;
    // Adaptive spin: the budget doubles (up to the maximum) when spinning caught the peer and
    // halves when it did not, so a ping-pong with a free core costs no system call while a
    // waiter whose peer is slow, idle or short of CPU (spinning would steal it) soon just
    // sleeps. At zero, every 16th wait probes with a quarter of the maximum to notice recovery.
    int64_t budget = spin_ns_;
    if (budget == 0 && spin_max_ns_ > 0 && (++spin_probe_ & 15) == 0) budget = spin_max_ns_ / 4;
    if (budget > 0) {
      int64_t spin_end = now_ns() + budget;
      if (interruptible && deadline >= 0) spin_end = std::min(spin_end, deadline);
      for (unsigned i = 1;; ++i) {
        cpu_relax();
        if (ready()) {
          spin_ns_ = std::min(spin_max_ns_, std::max(2 * spin_ns_, budget));
          return;
        }
        if ((i & 63) == 0 && now_ns() >= spin_end) break;
      }
      spin_ns_ = spin_ns_ >= 2000 ? spin_ns_ / 2 : 0;
    }
    Side& me = self();
    Side& other = peer();
    struct WaitingFlag {
      std::atomic<uint32_t>& flag;
      ~WaitingFlag() { flag.store(0, std::memory_order_relaxed); }
    } guard{me.waiting};
    int64_t next_check = now_ns();
    for (;;) {
      const uint32_t seq = other.seq.load(std::memory_order_acquire);
      me.wake_pos.store(wake_pos, std::memory_order_relaxed);
      me.waiting.store(1, std::memory_order_release);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (ready()) return;
      ensure_open_locked();
      if (other.closed.load(std::memory_order_acquire)) {
        if (writer_) throw ClosedError("channel " + name_ + ": the reader closed it");
        throw ClosedError(std::string("channel ") + name_ + ": the writer closed it" +
                          (interruptible ? " (no more messages)" : " in the middle of a message"));
      }
      int64_t t = now_ns();
      if (t >= next_check) {
        check_peer_alive(what);
        if (interruptible) {
          nb::gil_scoped_acquire gil;
          if (PyErr_CheckSignals() != 0) throw nb::python_error();
        }
        t = now_ns();
        next_check = t + kCheckIntervalNs;
      }
      int64_t sleep_ns = next_check - t;
      if (interruptible && deadline >= 0) {
        if (t >= deadline)
          throw TimeoutErr("channel " + name_ + ": timed out after " + seconds(timeout) +
                           " s waiting for " + what);
        sleep_ns = std::min(sleep_ns, deadline - t);
      }
      futex_wait(&other.seq, seq, std::max<int64_t>(sleep_ns, 1000));
    }
  }

  // Writer, mutex held, GIL released.
  void send_slow(const uint8_t* src, uint64_t n, int64_t deadline,
                 const std::optional<double>& timeout) {
    const uint64_t total = kFrameHeader + n;
    const uint64_t piece = cap_ / 4;
    if (total <= cap_) {
      // The ring is full: wait for a quarter of it (or the frame, if larger) to drain, so a
      // writer ahead of its reader sleeps once per quarter ring instead of once per message.
      wait_for(std::max(total, piece), deadline, true, timeout, "room");
      write_frame(src, n);
      return;
    }
    // Stream: the caller's timeout covers the wait for room to begin; once the header is in,
    // the message is committed and finishes as fast as the reader drains it.
    wait_for(kFrameHeader + piece, deadline, true, timeout, "room");
    uint8_t header[kFrameHeader];
    for (int i = 0; i < 8; ++i) header[i] = uint8_t(n >> (8 * i));
    copy_in(my_pos_, header, kFrameHeader);
    my_pos_ += kFrameHeader;
    uint64_t done = 0;
    for (;;) {
      uint64_t k = std::min(free_space(1), n - done);
      copy_in(my_pos_, src + done, k);
      my_pos_ += k;
      done += k;
      publish();
      if (done == n) return;
      wait_for(std::min(piece, n - done), -1, false, timeout, "room");
    }
  }

  // Reader, mutex and GIL held: a complete small message, or null.
  nb::object take_small() {
    if (available(kFrameHeader) < kFrameHeader) return nb::object();
    const uint64_t n = read_length();
    if (n > kGilCopyLimit || available(kFrameHeader + n) < kFrameHeader + n) return nb::object();
    PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n));
    if (!out) throw nb::python_error();
    copy_out(my_pos_ + kFrameHeader, reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out)), n);
    my_pos_ += kFrameHeader + n;
    publish();
    return nb::steal(out);
  }

  // Reader, mutex and GIL held, a frame header of length n at my_pos_: read the whole message.
  nb::object take_body(uint64_t n) {
    PyObject* raw = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n));
    if (!raw) {
      PyErr_Clear();
      mark_closed();
      throw CorruptError("channel " + name_ + ": cannot allocate " + std::to_string(n) +
                         " bytes for the message that arrives (out of memory); the stream "
                         "cannot go on, so this end is closed. Lower DTORCH_MAX_MESSAGE_BYTES "
                         "or send smaller messages");
    }
    nb::object out = nb::steal(raw);
    auto* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(raw));
    std::optional<double> no_timeout;
    nb::gil_scoped_release release;
    if (kFrameHeader + n <= cap_) {
      // Whole frames are published at once; this wait only matters for a racing publish.
      wait_for(kFrameHeader + n, -1, false, no_timeout, "the rest of a message");
      copy_out(my_pos_ + kFrameHeader, dst, n);
      my_pos_ += kFrameHeader + n;
      publish();
    } else {
      my_pos_ += kFrameHeader;
      uint64_t done = 0;
      while (done < n) {
        wait_for(1, -1, false, no_timeout, "the rest of a message");
        uint64_t k = std::min(available(1), n - done);
        copy_out(my_pos_, dst + done, k);
        my_pos_ += k;
        done += k;
        publish();
      }
    }
    return out;
  }

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

void set_type(PyObject*& slot, nb::handle type) {
  Py_XINCREF(type.ptr());
  Py_XDECREF(slot);
  slot = type.ptr();
}

void set_error_types(nb::handle closed_type, nb::handle timeout_type, nb::handle corrupt_type,
                     nb::handle too_large_type) {
  set_type(g_closed_type, closed_type);
  set_type(g_timeout_type, timeout_type);
  set_type(g_corrupt_type, corrupt_type.is_none() ? closed_type : corrupt_type);
  set_type(g_too_large_type, too_large_type.is_none() ? nb::handle() : too_large_type);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "dtorch native hot paths: the shared-memory ring channel of the local transport.";
  m.attr("LAYOUT_VERSION") = kLayoutVersion;

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CorruptError& e) {
      PyErr_SetString(g_corrupt_type ? g_corrupt_type
                                     : (g_closed_type ? g_closed_type : PyExc_ConnectionError),
                      e.what());
    } catch (const TooLargeError& e) {
      PyErr_SetString(g_too_large_type ? g_too_large_type : PyExc_ValueError, e.what());
    } catch (const ClosedError& e) {
      PyErr_SetString(g_closed_type ? g_closed_type : PyExc_ConnectionError, e.what());
    } catch (const TimeoutErr& e) {
      PyErr_SetString(g_timeout_type ? g_timeout_type : PyExc_TimeoutError, e.what());
    } catch (const OsError& e) {
      PyObject* args = Py_BuildValue("(is)", e.code, e.what());
      if (args) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
      }
    } catch (const UsageError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("set_error_types", &set_error_types, "closed"_a, "timeout"_a,
        "corrupt"_a = nb::none(), "too_large"_a = nb::none(),
        "Exception classes raised for a closed channel, a timeout, a corrupt channel (bad "
        "positions or lengths from the peer) and a message over max_message.");
  m.attr("MAX_MESSAGE") = kMaxMessage;

  nb::class_<ShmChannel>(m, "ShmChannel",
                         "One end of a one-direction shared-memory ring channel.")
      .def(nb::init<const std::string&, const std::string&, bool, uint64_t, double, uint64_t>(),
           "name"_a, "role"_a, "create"_a, "capacity"_a = uint64_t(1) << 20, "spin_us"_a = 50.0,
           "max_message"_a = kMaxMessage,
           "Create (create=True) or open the shared-memory object `name` as its 'send' or "
           "'recv' end. The capacity is rounded up to a power of two of at least 4096 bytes; "
           "messages over max_message bytes (0: 2^47) are refused both ways.")
      .def("send", &ShmChannel::send, "data"_a, "timeout"_a = nb::none(),
           "Send one message (any contiguous buffer). Blocks while the ring is full; the timeout "
           "bounds the wait for room to begin the message.")
      .def("recv", &ShmChannel::recv, "timeout"_a = nb::none(),
           "Receive one message as bytes; None waits forever. The timeout bounds the wait for a "
           "message to begin.")
      .def("try_recv", &ShmChannel::try_recv,
           "A message if one has begun arriving, else None; never waits for a message to begin.")
      .def("close", &ShmChannel::close, "Close this end; the peer's waits end with an error.")
      .def("expect_peer", &ShmChannel::expect_peer, "pid"_a,
           "Watch process `pid` as the other end before it has opened the channel.")
      .def_prop_ro("closed", &ShmChannel::closed)
      .def_prop_ro("name", &ShmChannel::name)
      .def_prop_ro("capacity", &ShmChannel::capacity)
      .def_prop_ro("max_message", &ShmChannel::max_message)
      .def_prop_ro("role", &ShmChannel::role)
      .def_prop_ro("pending", &ShmChannel::pending,
                   "Bytes published and not yet consumed (a diagnostic).");
}
