// Asynchronous file I/O for NVMe swap: the `cpp` backend of slipstream.offload.aio.
//
// Python plans a transfer (slipstream/offload/aio/engine.py): it cuts a tensor into ops of at
// most `block_size` bytes, each either *direct* (the tensor's own memory, already aligned for
// O_DIRECT) or *staged* (copied through an aligned bounce buffer, for an unaligned tensor or the
// sub-4096-byte tail of an aligned one). This file only executes those ops, so the planning rules
// live in one place and both backends write the same bytes to disk.
//
// Two ways to execute them:
// - Kernel AIO (O_DIRECT files): `threads` workers, each with its own io_context of
//   `queue_depth` slots, submitting through raw syscall(SYS_io_submit) (no libaio needed).
//   `single_submit` submits slot by slot instead of in one io_submit per batch;
//   `overlap_events` refills slots as soon as completions are reaped, instead of waiting for a
//   whole batch. Without O_DIRECT, io_submit runs synchronously inside the kernel, so kernel
//   AIO would serialise buffered I/O: those engines use the thread pool.
// - A thread pool: `threads × queue_depth` workers each blocked in pread/pwrite, which keeps
//   the same number of requests in flight on any file system. It is also the fallback when
//   io_setup fails (seccomp, aio-max-nr exhausted, no AIO in the kernel), with the reason
//   exposed as `Engine.mode_reason`.
//
// Errors are never thrown from a worker: the first failure of a batch (errno, file offset,
// length, bytes done) is recorded and returned by `Batch.wait()`, and Python turns it into the
// right OffloadIOError subclass (it knows the path, the settings and the file system). Short
// reads/writes are continued until the op is complete; a read that hits the end of the file
// before the bytes it needs reports kUnexpectedEof.

#include <fcntl.h>
#include <linux/aio_abi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kAlign = 4096;
constexpr int kUnexpectedEof = -1;  // reported instead of an errno: the file ended too early
constexpr int kShortOnce = -1;      // Op::inject value: make the first syscall transfer half

// One request of at most block_size bytes: file bytes [offset, offset + io_len) to or from
// `user` (direct) or the worker's bounce buffer (staged, of which `need` bytes belong to the
// tensor; the rest is zero padding on write and discarded on read).
struct Op {
  uint8_t* user;
  int64_t io_len;
  int64_t need;
  int64_t offset;
  bool staged;
  int inject;  // test seam: >0 fails the op with that errno; kShortOnce forces a short transfer
};

// The ops of one engine request (one tensor to or from one file). Owns the file descriptor
// when `close_fd`, closing it once every op has finished, so a caller that never waits does
// not leak descriptors.
class Batch {
 public:
  Batch(int fd, bool write, bool direct, bool close_fd, size_t count)
      : fd_(fd), write_(write), direct_(direct), close_fd_(close_fd), remaining_(count) {}

  int fd() const { return fd_; }
  bool is_write() const { return write_; }
  bool direct() const { return direct_; }

  void finish_op(int err, int64_t offset, int64_t length, int64_t transferred) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (err != 0 && err_ == 0) {
      err_ = err;
      err_offset_ = offset;
      err_length_ = length;
      err_done_ = transferred;
    }
    if (--remaining_ == 0) {
      if (close_fd_) ::close(fd_);
      cv_.notify_all();
    }
  }

  // (errno or 0 or kUnexpectedEof, file offset, length, bytes transferred) of the first error.
  std::tuple<int, int64_t, int64_t, int64_t> wait() {
    py::gil_scoped_release no_gil;
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return remaining_ == 0; });
    return {err_, err_offset_, err_length_, err_done_};
  }

  bool done() {
    std::lock_guard<std::mutex> guard(mutex_);
    return remaining_ == 0;
  }

 private:
  int fd_;
  bool write_;
  bool direct_;
  bool close_fd_;
  size_t remaining_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int err_ = 0;
  int64_t err_offset_ = 0;
  int64_t err_length_ = 0;
  int64_t err_done_ = 0;
};

struct Task {
  std::shared_ptr<Batch> batch;
  Op op;
};

// The bytes of the next syscall of `op` after `done` bytes; halves the first one when the
// short-transfer test seam is set (4096-aligned with O_DIRECT).
int64_t next_length(const Op& op, const Batch& batch, int64_t done, bool* shorten) {
  int64_t length = op.io_len - done;
  if (*shorten) {
    int64_t half = batch.direct() ? (length / 2) / kAlign * kAlign : length / 2;
    if (half > 0) length = half;
    *shorten = false;
  }
  return length;
}

enum class Step { kMore, kDone, kFail };

// Accounts for a transfer of `got` bytes out of `length` asked: more to do, done, or failed
// (`*err`). A read that comes back short may have hit the end of the file: fine once the tensor's
// bytes are in (the rest is padding, absent from files written without O_DIRECT). With O_DIRECT
// a short read ending at an unaligned position can only be the end of the file (and a retry
// from there would fail with EINVAL): an error if bytes are missing. Otherwise keep reading;
// a read at the end of the file returns 0.
Step advance(const Op& op, const Batch& batch, int64_t length, int64_t got, int64_t* done,
             int* err) {
  if (got == 0) {
    if (batch.is_write()) {
      *err = EIO;  // a write that makes no progress would spin forever
      return Step::kFail;
    }
    if (*done >= op.need) return Step::kDone;
    *err = kUnexpectedEof;
    return Step::kFail;
  }
  *done += got;
  const bool unaligned = batch.direct() && *done % kAlign != 0;
  if (!batch.is_write() && got < length && (*done >= op.need || unaligned)) {
    if (*done >= op.need) return Step::kDone;
    *err = kUnexpectedEof;
    return Step::kFail;
  }
  return *done >= op.io_len ? Step::kDone : Step::kMore;
}

void stage_in(const Op& op, const Batch& batch, uint8_t* bounce) {
  if (op.staged && batch.is_write()) {
    std::memcpy(bounce, op.user, static_cast<size_t>(op.need));
    std::memset(bounce + op.need, 0, static_cast<size_t>(op.io_len - op.need));
  }
}

void stage_out(const Op& op, const Batch& batch, const uint8_t* bounce) {
  if (op.staged && !batch.is_write()) {
    std::memcpy(op.user, bounce, static_cast<size_t>(op.need));
  }
}

// Runs one op to completion with pread/pwrite (continuing short transfers, retrying EINTR).
// Returns 0, an errno, or kUnexpectedEof; `done` receives the bytes transferred.
int run_op(const Op& op, const Batch& batch, uint8_t* bounce, int64_t* done) {
  *done = 0;
  if (op.inject > 0) return op.inject;
  uint8_t* buffer = op.staged ? bounce : op.user;
  stage_in(op, batch, bounce);
  bool shorten = op.inject == kShortOnce;
  while (true) {
    int64_t length = next_length(op, batch, *done, &shorten);
    ssize_t got = batch.is_write()
                      ? ::pwrite(batch.fd(), buffer + *done, static_cast<size_t>(length),
                                 static_cast<off_t>(op.offset + *done))
                      : ::pread(batch.fd(), buffer + *done, static_cast<size_t>(length),
                                static_cast<off_t>(op.offset + *done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    int err = 0;
    Step step = advance(op, batch, length, got, done, &err);
    if (step == Step::kFail) return err;
    if (step == Step::kDone) break;
  }
  stage_out(op, batch, bounce);
  return 0;
}

// Raw kernel AIO syscalls (glibc has no wrappers; libaio is not needed for these four).
long sys_io_setup(unsigned nr, aio_context_t* ctx) { return ::syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return ::syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, iocb** cbs) {
  return ::syscall(SYS_io_submit, ctx, n, cbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long max_nr, io_event* events) {
  return ::syscall(SYS_io_getevents, ctx, min_nr, max_nr, events, nullptr);
}

uint8_t* aligned_alloc_bytes(int64_t bytes) {
  void* raw = nullptr;
  if (::posix_memalign(&raw, kAlign, static_cast<size_t>(bytes)) != 0) return nullptr;
  return static_cast<uint8_t*>(raw);
}

class Engine {
 public:
  // `threads` workers; with `kernel_aio` each drives an io_context of `queue_depth` slots,
  // otherwise (or when io_setup fails) `threads × queue_depth` pread/pwrite workers.
  Engine(int threads, int queue_depth, int64_t bounce_bytes, bool kernel_aio, bool single_submit,
         bool overlap_events)
      : queue_depth_(queue_depth),
        bounce_bytes_(bounce_bytes),
        single_submit_(single_submit),
        overlap_events_(overlap_events) {
    if (threads < 1 || queue_depth < 1) {
      throw std::invalid_argument("threads and queue_depth must be >= 1");
    }
    if (bounce_bytes < kAlign || bounce_bytes % kAlign != 0) {
      throw std::invalid_argument("bounce_bytes must be a positive multiple of 4096");
    }
    if (kernel_aio) {
      for (int i = 0; i < threads; ++i) {
        aio_context_t ctx = 0;
        if (sys_io_setup(static_cast<unsigned>(queue_depth), &ctx) != 0) {
          mode_reason_ = std::string("io_setup failed: ") + std::strerror(errno);
          for (aio_context_t made : contexts_) sys_io_destroy(made);
          contexts_.clear();
          break;
        }
        contexts_.push_back(ctx);
      }
    } else {
      mode_reason_ = "kernel AIO not requested (it is only used with O_DIRECT)";
    }
    if (!contexts_.empty()) {
      for (aio_context_t ctx : contexts_) workers_.emplace_back([this, ctx] { aio_work(ctx); });
    } else {
      for (int i = 0; i < threads * queue_depth; ++i) workers_.emplace_back([this] { work(); });
    }
  }

  ~Engine() { stop(); }

  int threads() const { return static_cast<int>(workers_.size()); }
  std::string mode() const { return contexts_.empty() ? "threads" : "kernel-aio"; }
  std::string mode_reason() const { return mode_reason_; }

  std::shared_ptr<Batch> submit(int fd, bool write, bool direct, bool close_fd,
                                const std::vector<int64_t>& pointers,
                                const std::vector<int64_t>& io_lens,
                                const std::vector<int64_t>& needs,
                                const std::vector<int64_t>& offsets,
                                const std::vector<bool>& staged, const std::vector<int>& injects) {
    const size_t count = pointers.size();
    if (count == 0 || io_lens.size() != count || needs.size() != count ||
        offsets.size() != count || staged.size() != count || injects.size() != count) {
      throw std::invalid_argument("submit: the op lists must be non-empty and of equal length");
    }
    for (size_t i = 0; i < count; ++i) {
      if (staged[i] && io_lens[i] > bounce_bytes_) {
        throw std::invalid_argument("submit: a staged op is larger than the bounce buffer");
      }
    }
    auto batch = std::make_shared<Batch>(fd, write, direct, close_fd, count);
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (stopping_) throw std::runtime_error("submit after close()");
      for (size_t i = 0; i < count; ++i) {
        Op op{reinterpret_cast<uint8_t*>(pointers[i]), io_lens[i], needs[i], offsets[i],
              static_cast<bool>(staged[i]), injects[i]};
        queue_.push_back(Task{batch, op});
      }
    }
    cv_.notify_all();
    return batch;
  }

  // Lets queued ops finish, then joins the workers and frees the io_contexts. Idempotent.
  void stop() {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    std::vector<std::thread> workers;
    {
      std::lock_guard<std::mutex> guard(stop_mutex_);
      workers.swap(workers_);
    }
    for (auto& worker : workers) worker.join();
    std::lock_guard<std::mutex> guard(stop_mutex_);
    for (aio_context_t ctx : contexts_) sys_io_destroy(ctx);
    contexts_.clear();
  }

 private:
  // Thread-pool worker: one op at a time with pread/pwrite.
  void work() {
    uint8_t* bounce = aligned_alloc_bytes(bounce_bytes_);
    while (true) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) break;  // stopping and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      int64_t done = 0;
      int err = (task.op.staged && bounce == nullptr) ? ENOMEM
                                                      : run_op(task.op, *task.batch, bounce, &done);
      task.batch->finish_op(err, task.op.offset, task.op.io_len, done);
    }
    std::free(bounce);
  }

  // One in-flight op of a kernel AIO worker.
  struct Slot {
    Task task;
    int64_t done = 0;
    int64_t length = 0;  // bytes asked by the iocb in flight
    bool shorten = false;
    bool busy = false;
    uint8_t* bounce = nullptr;
    iocb cb{};
  };

  void prepare(Slot& slot) {
    const Op& op = slot.task.op;
    const Batch& batch = *slot.task.batch;
    uint8_t* buffer = op.staged ? slot.bounce : op.user;
    slot.length = next_length(op, batch, slot.done, &slot.shorten);
    std::memset(&slot.cb, 0, sizeof(slot.cb));
    slot.cb.aio_data = reinterpret_cast<uint64_t>(&slot);
    slot.cb.aio_lio_opcode = batch.is_write() ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    slot.cb.aio_fildes = static_cast<uint32_t>(batch.fd());
    slot.cb.aio_buf = reinterpret_cast<uint64_t>(buffer + slot.done);
    slot.cb.aio_nbytes = static_cast<uint64_t>(slot.length);
    slot.cb.aio_offset = op.offset + slot.done;
  }

  static void finish(Slot& slot, int err) {
    if (err == 0) stage_out(slot.task.op, *slot.task.batch, slot.bounce);
    slot.task.batch->finish_op(err, slot.task.op.offset, slot.task.op.io_len, slot.done);
    slot.task = Task{};  // drop the batch reference now, not when the slot is reused
    slot.busy = false;
  }

  // Submits `cbs` (one call, or one per iocb with single_submit); an iocb the kernel refuses
  // finishes its op with that errno. Returns how many are now in flight.
  int submit_iocbs(aio_context_t ctx, std::vector<iocb*>& cbs) {
    int in_flight = 0;
    size_t next = 0;
    while (next < cbs.size()) {
      long want = single_submit_ ? 1 : static_cast<long>(cbs.size() - next);
      long got = sys_io_submit(ctx, want, cbs.data() + next);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {  // the first iocb of this call was refused
        int err = got < 0 ? errno : EIO;
        finish(*reinterpret_cast<Slot*>(cbs[next]->aio_data), err);
        ++next;
        continue;
      }
      in_flight += static_cast<int>(got);
      next += static_cast<size_t>(got);
    }
    cbs.clear();
    return in_flight;
  }

  // Kernel AIO worker: keeps up to queue_depth ops of the shared queue in flight on `ctx`.
  void aio_work(aio_context_t ctx) {
    std::vector<Slot> slots(static_cast<size_t>(queue_depth_));
    bool out_of_memory = false;
    for (auto& slot : slots) {
      slot.bounce = aligned_alloc_bytes(bounce_bytes_);
      out_of_memory = out_of_memory || slot.bounce == nullptr;
    }
    std::vector<io_event> events(static_cast<size_t>(queue_depth_));
    std::vector<iocb*> to_submit;
    int in_flight = 0;
    while (true) {
      std::vector<Slot*> fresh;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (in_flight == 0) {
          cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
          if (queue_.empty()) break;  // stopping and drained
        }
        // overlap_events: refill free slots while others are in flight; otherwise only
        // start a new batch once the previous one has been reaped completely.
        if (overlap_events_ || in_flight == 0) {
          for (auto& slot : slots) {
            if (queue_.empty()) break;
            if (slot.busy) continue;
            slot.task = std::move(queue_.front());
            queue_.pop_front();
            slot.busy = true;
            slot.done = 0;
            slot.shorten = slot.task.op.inject == kShortOnce;
            fresh.push_back(&slot);
          }
        }
      }
      for (Slot* slot : fresh) {
        const Op& op = slot->task.op;
        if (op.inject > 0) {
          finish(*slot, op.inject);
        } else if (out_of_memory) {
          finish(*slot, ENOMEM);
        } else {
          stage_in(op, *slot->task.batch, slot->bounce);
          prepare(*slot);
          to_submit.push_back(&slot->cb);
        }
      }
      in_flight += submit_iocbs(ctx, to_submit);
      if (in_flight == 0) continue;
      long min_nr = overlap_events_ ? 1 : in_flight;
      long reaped = sys_io_getevents(ctx, min_nr, queue_depth_, events.data());
      if (reaped < 0) {
        if (errno == EINTR) continue;
        // Only a bug (a bad context or events pointer) gets here. Fail the ops in flight
        // instead of hanging their waiters or terminating the process from a worker thread.
        int err = errno;
        for (auto& slot : slots) {
          if (slot.busy) finish(slot, err);
        }
        in_flight = 0;
        continue;
      }
      for (long i = 0; i < reaped; ++i) {
        Slot& slot = *reinterpret_cast<Slot*>(events[i].data);
        --in_flight;
        int64_t res = events[i].res;
        if (res < 0) {
          finish(slot, static_cast<int>(-res));
          continue;
        }
        int err = 0;
        Step step = advance(slot.task.op, *slot.task.batch, slot.length, res, &slot.done, &err);
        if (step == Step::kFail) {
          finish(slot, err);
        } else if (step == Step::kDone) {
          finish(slot, 0);
        } else {  // a short transfer: submit the rest
          prepare(slot);
          to_submit.push_back(&slot.cb);
        }
      }
      in_flight += submit_iocbs(ctx, to_submit);
    }
    for (auto& slot : slots) std::free(slot.bounce);
  }

  int queue_depth_;
  int64_t bounce_bytes_;
  bool single_submit_;
  bool overlap_events_;
  std::string mode_reason_;
  std::vector<aio_context_t> contexts_;
  std::vector<std::thread> workers_;
  std::deque<Task> queue_;
  std::mutex mutex_;
  std::mutex stop_mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream NVMe swap I/O: kernel AIO or a pread/pwrite thread pool";
  m.attr("UNEXPECTED_EOF") = kUnexpectedEof;
  m.attr("SHORT_ONCE") = kShortOnce;
  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def("wait", &Batch::wait,
           "Block (GIL released) until every op finished; (errno, offset, length, done) of the "
           "first failure, errno 0 when all succeeded")
      .def("done", &Batch::done);
  py::class_<Engine>(m, "Engine")
      .def(py::init<int, int, int64_t, bool, bool, bool>(), py::arg("threads"),
           py::arg("queue_depth"), py::arg("bounce_bytes"), py::arg("kernel_aio"),
           py::arg("single_submit"), py::arg("overlap_events"))
      .def("submit", &Engine::submit, py::arg("fd"), py::arg("write"), py::arg("direct"),
           py::arg("close_fd"), py::arg("pointers"), py::arg("io_lens"), py::arg("needs"),
           py::arg("offsets"), py::arg("staged"), py::arg("injects"))
      .def("stop", &Engine::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("mode", &Engine::mode)
      .def_property_readonly("mode_reason", &Engine::mode_reason);
}
