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

#include "shm_channel.h"

namespace dtorch_shm {

ShmChannel::ShmChannel(const std::string& name, const std::string& role, bool create, uint64_t capacity,
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

ShmChannel::~ShmChannel() {
  mark_closed();
  release_resources();
}

void ShmChannel::send(nb::handle data, std::optional<double> timeout) {
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

nb::object ShmChannel::recv(std::optional<double> timeout) {
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

nb::object ShmChannel::try_recv() {
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

void ShmChannel::set_hungry() {
  if (writer_) throw UsageError("this end of channel " + name_ + " sends; only the receiving end is hungry");
  std::lock_guard<std::mutex> lk(mu_);
  ensure_open_locked();
  self().hungry.store(1, std::memory_order_release);
}

bool ShmChannel::peer_hungry() {
  if (!writer_) throw UsageError("this end of channel " + name_ + " receives; ask the sending end");
  // Never wait for the lock here: a send in flight on another thread (runners/sending.py) holds
  // it for as long as the reader takes to drain a large message, and the caller (the session's
  // hot path, holding the GIL) must not stall behind it; when that send ran on the main thread
  // it also took the GIL to check for signals, a deadlock. A busy lock means a send is feeding
  // the reader anyway.
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  ensure_open_locked();
  return peer().hungry.load(std::memory_order_acquire) != 0;
}

uintptr_t ShmChannel::hungry_word() {
  if (!writer_) throw UsageError("this end of channel " + name_ + " receives; ask the sending end");
  std::lock_guard<std::mutex> lk(mu_);
  ensure_open_locked();
  return reinterpret_cast<uintptr_t>(&peer().hungry);
}

void ShmChannel::close() {
  mark_closed();
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lk(mu_);  // waits for an operation in flight to notice and leave
  release_resources();
}

uint64_t ShmChannel::pending() {
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lk(mu_);
  if (!hdr_) return 0;
  return hdr_->writer.pos.load(std::memory_order_acquire) -
         hdr_->reader.pos.load(std::memory_order_acquire);
}

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

}  // namespace dtorch_shm

using namespace dtorch_shm;


NB_MODULE(_native, m) {
  m.doc() = "dtorch native hot paths: the shared-memory ring channel of the local transport.";
  m.attr("LAYOUT_VERSION") = kLayoutVersion;
  g_main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));

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
      .def("set_hungry", &ShmChannel::set_hungry,
           "Receiving end: everything is taken and this end's device has run dry (cleared by "
           "the next message either way).")
      .def("peer_hungry", &ShmChannel::peer_hungry,
           "Sending end: whether the receiver said it is hungry since the last send.")
      .def("hungry_word", &ShmChannel::hungry_word,
           "Sending end: the address of the receiver's hungry flag (a 32-bit word), valid until "
           "this end is closed.")
      .def_prop_ro("closed", &ShmChannel::closed)
      .def_prop_ro("name", &ShmChannel::name)
      .def_prop_ro("capacity", &ShmChannel::capacity)
      .def_prop_ro("max_message", &ShmChannel::max_message)
      .def_prop_ro("role", &ShmChannel::role)
      .def_prop_ro("pending", &ShmChannel::pending,
                   "Bytes published and not yet consumed (a diagnostic).");
}
