// The ring of dtorch_core._native's ShmChannel (native/shm_channel.h): the shared segment's
// setup and teardown, the ring arithmetic and copies, and the waits for the peer.
#include "shm_channel.h"

namespace dtorch_shm {

void ShmChannel::create_segment(uint64_t capacity) {
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

void ShmChannel::open_segment() {
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

void ShmChannel::map(int fd, size_t len) {
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

void ShmChannel::unmap() {
  if (hdr_) munmap(hdr_, map_len_);
  hdr_ = nullptr;
  data_ = nullptr;
}

void ShmChannel::mark_closed() {
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

void ShmChannel::release_resources() {
  unmap();
  if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
  peer_pidfd_ = -1;
  if (creator_ && !unlinked_) shm_unlink(name_.c_str());  // ENOENT once the opener unlinked it
  unlinked_ = true;
}

uint64_t ShmChannel::free_space(uint64_t need) {
  uint64_t f = cap_ - (my_pos_ - peer_pos_);
  if (f >= need) return f;
  const uint64_t p = peer().pos.load(std::memory_order_acquire);
  if (my_pos_ - p > cap_) corrupt_position(p);
  peer_pos_ = p;
  return cap_ - (my_pos_ - peer_pos_);
}

uint64_t ShmChannel::available(uint64_t need) {
  uint64_t a = peer_pos_ - my_pos_;
  if (a >= need) return a;
  const uint64_t p = peer().pos.load(std::memory_order_acquire);
  if (p - my_pos_ > cap_) corrupt_position(p);
  peer_pos_ = p;
  return peer_pos_ - my_pos_;
}

void ShmChannel::corrupt_position(uint64_t p) {
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

void ShmChannel::copy_in(uint64_t pos, const uint8_t* src, uint64_t n) {
  uint64_t off = pos & mask_;
  uint64_t first = std::min(n, cap_ - off);
  std::memcpy(data_ + off, src, first);
  if (n > first) std::memcpy(data_, src + first, n - first);
}

void ShmChannel::copy_out(uint64_t pos, uint8_t* dst, uint64_t n) const {
  uint64_t off = pos & mask_;
  uint64_t first = std::min(n, cap_ - off);
  std::memcpy(dst, data_ + off, first);
  if (n > first) std::memcpy(dst + first, data_, n - first);
}

void ShmChannel::publish() {
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

void ShmChannel::write_frame(const uint8_t* src, uint64_t n) {
  peer().hungry.store(0, std::memory_order_relaxed);  // before the frame is visible: it feeds the reader
  uint8_t header[kFrameHeader];
  for (int i = 0; i < 8; ++i) header[i] = uint8_t(n >> (8 * i));
  copy_in(my_pos_, header, kFrameHeader);
  copy_in(my_pos_ + kFrameHeader, src, n);
  my_pos_ += kFrameHeader + n;
  publish();
}

uint64_t ShmChannel::read_length() {
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

void ShmChannel::ensure_open_locked() {
  if (closed_.load(std::memory_order_acquire) || !hdr_)
    throw ClosedError("channel " + name_ + ": this end is closed");
}

void ShmChannel::send_checks(bool force) {
  if (peer().closed.load(std::memory_order_acquire))
    throw ClosedError("channel " + name_ + ": the reader closed it");
  int64_t t = now_ns();
  if (force || t >= next_send_check_) {
    next_send_check_ = t + kSendCheckIntervalNs;
    check_peer_alive("room");
  }
}

void ShmChannel::check_peer_alive(const char* what) {
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

void ShmChannel::peer_gone(int pid, const char* what) {
  throw ClosedError("channel " + name_ + ": the " + (writer_ ? "reader" : "writer") +
                    " process " + std::to_string(pid) + " exited while waiting for " + what);
}

void ShmChannel::wait_for(uint64_t need, int64_t deadline, bool interruptible,
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
      if (interruptible && on_signal_thread()) {
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

void ShmChannel::send_slow(const uint8_t* src, uint64_t n, int64_t deadline,
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

nb::object ShmChannel::take_small() {
  if (available(kFrameHeader) < kFrameHeader) return nb::object();
  self().hungry.store(0, std::memory_order_relaxed);
  const uint64_t n = read_length();
  if (n > kGilCopyLimit || available(kFrameHeader + n) < kFrameHeader + n) return nb::object();
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(n));
  if (!out) throw nb::python_error();
  copy_out(my_pos_ + kFrameHeader, reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out)), n);
  my_pos_ += kFrameHeader + n;
  publish();
  return nb::steal(out);
}

nb::object ShmChannel::take_body(uint64_t n) {
  self().hungry.store(0, std::memory_order_relaxed);
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

}  // namespace dtorch_shm
