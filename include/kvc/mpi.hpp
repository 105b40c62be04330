#pragma once
// kvc::mpi: caches sent between the ranks of an MPI job (docs/distributed.md). Needs the target
// kvc::mpi (kvc::kvc + MPI::MPI_CXX: find_package(kvc COMPONENTS mpi), or kvc's own build with
// MPI found); MPI must be initialised before anything here is used.
//
// Everything here is the serialization of <kvc/state.hpp> over point-to-point messages:
//   Sink, Source              the byte channel (a Sink's puts arrive as a Source's gets, in order)
//   send, receive             a whole cache: write_state on one rank, StateLoader on the other
//   LayerReceiver             the loader kept open, so a decode rank pulls layer l just before it
//                             attends with it while the later layers have not yet been received
//   send_request, receive_request   one request of a PagedCache (write_request, read_request)
//   min_over_ranks            PagedTensorParallel::min_over_ranks as an MPI_Allreduce(MPI_MIN)
//
// The channel. The state writer makes many small puts (scalars, shapes: a few bytes each) and a few
// large ones (contiguous K/V rows, straight from the cache's memory). A put below batch_threshold
// bytes is copied into the current batch; a large put first sends the batch (if not empty) as one
// message, then goes out as its own message, posted with MPI_Isend on the caller's memory, without
// a copy. finish() sends the last batch and waits for every message. The Source mirrors it: a small
// get reads from the current batch, receiving the next message as the new batch when the current
// one is used up (its size from MPI_Mprobe); a large get receives its own message directly into the
// destination. The loader's gets mirror the writer's puts exactly, so both ends agree on which
// message is a batch. A put longer than 1 GiB goes as several messages of at most 1 GiB (MPI's
// count is an int), on both ends alike. The stream ends with an empty message, which no put
// produces: the Sink sends it at finish(), or from its destructor when writing stopped early (an
// exception), so a receiver reads "the stream ended early" instead of waiting forever; a Source
// given up before the end (its reader threw: a header that does not match, say) receives and drops
// the rest of the stream up to that marker, so the sender's finish() returns instead of waiting
// for a receive that never comes. Both ends then report the error; neither hangs.
//
// No checksum: MPI delivers a message whole and unchanged or reports an error, and the stream's
// header (the cache's fingerprint) is still checked by the loader. Every message of one transfer
// uses the Sink's tag; messages between two ranks with one tag and communicator arrive in the
// order they were sent (MPI's non-overtaking rule), which is all the channel relies on. Use a tag
// of its own per concurrent transfer between the same two ranks.
//
// Errors. Every MPI call's return code is checked; a failure throws kvc::RuntimeError with MPI's
// error string. For that, kvc sets MPI_ERRORS_RETURN on the communicator around each of its calls
// and puts the previous handler back after (MPI's default, MPI_ERRORS_ARE_FATAL, would abort the
// job instead). A stream that does not match what is read (it ends early, has more, or has a
// message of another size: the two ends disagree) throws kvc::StateError, as a truncated file
// does for kvc::load. The handler swap is not synchronised: threads that use kvc::mpi at the same
// time need a communicator each (MPI_Comm_dup).
#include <kvc/errors.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/state.hpp>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#if !__has_include(<mpi.h>)
#error \
    "<kvc/mpi.hpp> needs MPI's <mpi.h>: link the target kvc::mpi (find_package(kvc COMPONENTS mpi)), not only kvc::kvc"
#endif
#include <mpi.h>

namespace kvc::mpi {

// Puts and gets below this many bytes travel batched; at or above it, as a message of their own.
// Both ends use this value.
inline constexpr std::size_t batch_threshold = 4096;

namespace detail {

// The largest piece of one large put sent as a single message (MPI counts are ints).
inline constexpr std::size_t max_message = std::size_t{1} << 30;

inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

// Throws kvc::RuntimeError "kvc::mpi: <what> failed: <MPI's error string>" unless code is MPI_SUCCESS.
inline void check(int code, const char* what) {
  if (code != MPI_SUCCESS)
    throw RuntimeError(kvc::detail::join_message({"kvc::mpi: ", what, " failed: ", error_string(code)}));
}

inline void require_initialized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw RuntimeError(
        "kvc::mpi: MPI is not initialized (call MPI_Init before using kvc::mpi, and not after MPI_Finalize)");
}

// MPI_ERRORS_RETURN on `comm` for the guard's lifetime, so that kvc sees error codes instead of
// the job being aborted; the communicator's own handler is put back on destruction. Only local
// calls: no other rank takes part.
class ErrorsReturn {
 public:
  explicit ErrorsReturn(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_get_errhandler(comm_, &previous_), "MPI_Comm_get_errhandler");
    if (const int rc = MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN); rc != MPI_SUCCESS) {
      MPI_Errhandler_free(&previous_);
      check(rc, "MPI_Comm_set_errhandler");
    }
  }
  ~ErrorsReturn() {
    MPI_Comm_set_errhandler(comm_, previous_);
    MPI_Errhandler_free(&previous_);  // the communicator keeps its own reference
  }
  ErrorsReturn(const ErrorsReturn&) = delete;
  ErrorsReturn& operator=(const ErrorsReturn&) = delete;

 private:
  MPI_Comm comm_;
  MPI_Errhandler previous_ = MPI_ERRHANDLER_NULL;
};

}  // namespace detail

// The sending end of the channel: put() as write_state and write_request call it, then finish().
// The memory given to a large put must stay unchanged and alive until finish() returns (it is sent
// from where it is); write_state reads a cache that the caller does not change meanwhile.
class Sink {
 public:
  // A channel to rank `dest` on `comm` with tag `tag`. RuntimeError when MPI is not initialized.
  Sink(int dest, int tag, MPI_Comm comm) : dest_(dest), tag_(tag), comm_(comm) { detail::require_initialized(); }
  Sink(const Sink&) = delete;
  Sink& operator=(const Sink&) = delete;

  // Destroyed without finish() (an exception while writing): sends the last batch and ends the
  // stream early, so that the receiver throws instead of waiting, and waits for the messages in
  // flight, since the memory they are sent from may be about to go. Errors are ignored here.
  ~Sink() {
    if (finished_) return;
    MPI_Errhandler previous = MPI_ERRHANDLER_NULL;
    const bool swapped = MPI_Comm_get_errhandler(comm_, &previous) == MPI_SUCCESS &&
                         MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN) == MPI_SUCCESS;
    auto post = [&](const void* data, std::size_t bytes) {
      MPI_Request request = MPI_REQUEST_NULL;
      if (MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, dest_, tag_, comm_, &request) == MPI_SUCCESS)
        requests_.push_back(request);
    };
    if (!batch_.empty()) post(batch_.data(), batch_.size());  // what was written before the stop
    post(nullptr, 0);                                         // the end marker
    MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    if (swapped) MPI_Comm_set_errhandler(comm_, previous);
    if (previous != MPI_ERRHANDLER_NULL) MPI_Errhandler_free(&previous);
  }

  // Sends `bytes` bytes from `data`: batched below batch_threshold, else as messages of their own
  // (then `data` must stay alive until finish()). RuntimeError after finish() or on an MPI error.
  void put(const void* data, std::size_t bytes) {
    if (finished_) throw RuntimeError("kvc::mpi::Sink: put after finish()");
    if (bytes == 0) return;
    if (bytes < batch_threshold) {
      const auto* p = static_cast<const std::byte*>(data);
      batch_.insert(batch_.end(), p, p + bytes);
      bytes_ += bytes;
      return;
    }
    const detail::ErrorsReturn errors(comm_);
    flush();
    const auto* p = static_cast<const std::byte*>(data);
    for (std::size_t sent = 0; sent < bytes;) {
      const std::size_t n = std::min(bytes - sent, detail::max_message);
      isend(p + sent, n);
      sent += n;
    }
    bytes_ += bytes;
  }

  // Sends what is batched and the end of the stream, and waits until every message has left this
  // rank's buffers (the receiver may not have read them all yet). The stream is over: no put after.
  void finish() {
    if (finished_) return;
    const detail::ErrorsReturn errors(comm_);
    flush();
    isend(nullptr, 0);  // the end marker
    finished_ = true;
    std::vector<MPI_Status> statuses(requests_.size());
    const int rc = MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), statuses.data());
    requests_.clear();
    sent_batches_.clear();
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& s : statuses) detail::check(s.MPI_ERROR, "MPI_Isend");
    }
    detail::check(rc, "MPI_Waitall");
  }

  // The number of bytes put so far.
  std::uint64_t bytes() const noexcept { return bytes_; }  // bytes put so far
  // The number of messages sent so far, the end marker included.
  std::uint64_t messages() const noexcept { return messages_; }  // messages sent so far, the end marker too

 private:
  void flush() {
    if (batch_.empty()) return;
    sent_batches_.push_back(std::move(batch_));  // kept alive until finish(): MPI reads it meanwhile
    batch_ = {};
    isend(sent_batches_.back().data(), sent_batches_.back().size());
  }
  void isend(const void* data, std::size_t bytes) {
    MPI_Request request = MPI_REQUEST_NULL;
    // MPI_Isend's buffer is `const void*` from MPI 3 on.
    detail::check(MPI_Isend(data, static_cast<int>(bytes), MPI_BYTE, dest_, tag_, comm_, &request), "MPI_Isend");
    requests_.push_back(request);
    ++messages_;
  }

  int dest_, tag_;
  MPI_Comm comm_;
  std::vector<std::byte> batch_;
  std::vector<std::vector<std::byte>> sent_batches_;
  std::vector<MPI_Request> requests_;
  std::uint64_t bytes_ = 0, messages_ = 0;
  bool finished_ = false;
};

// The receiving end: the Source a StateLoader (or read_request) reads from, then finish(). `source`
// may be MPI_ANY_SOURCE: the first message fixes the peer. available() is max_bytes minus what was
// read: the default trusts the peer (a rank of the same job) with any size; pass a bound to cap
// what a loader may allocate. Destroyed before the stream's end (finish() not reached: the reader
// threw), it receives and drops the rest of the stream, so that the sender is not left waiting.
class Source {
 public:
  // A channel from rank `source` (or MPI_ANY_SOURCE) on `comm` with tag `tag`, allowing at most
  // `max_bytes` to be read. RuntimeError when MPI is not initialized.
  Source(int source, int tag, MPI_Comm comm, std::uint64_t max_bytes = std::numeric_limits<std::uint64_t>::max())
      : peer_(source), tag_(tag), comm_(comm), max_bytes_(max_bytes) {
    detail::require_initialized();
  }
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  ~Source() {
    if (ended_) return;
    try {
      const detail::ErrorsReturn errors(comm_);
      while (!ended_) {
        Message m = receive_message();
        drop(m);
      }
    } catch (...) {  // an MPI error while dropping: nothing more to do here
    }
  }

  // Reads the next `bytes` bytes of the stream into `data`, mirroring the sender's put. StateError
  // past available(), when the stream ended or the reads do not mirror the puts; RuntimeError on an
  // MPI error.
  void get(void* data, std::size_t bytes) {
    if (bytes == 0) return;
    if (bytes > available())
      throw StateError(
          kvc::detail::join_message({"kvc::mpi::Source: a read of ", std::to_string(bytes), " bytes exceeds the ",
                                     std::to_string(available()), " bytes still allowed"}));
    if (ended_) throw ended_early();
    if (bytes < batch_threshold) {
      if (next_ == batch_.size()) {
        const detail::ErrorsReturn errors(comm_);
        Message m = receive_message();
        if (ended_) throw ended_early();
        batch_.resize(m.bytes);
        next_ = 0;
        detail::check(MPI_Mrecv(batch_.data(), m.count(), MPI_BYTE, &m.handle, MPI_STATUS_IGNORE), "MPI_Mrecv");
      }
      if (batch_.size() - next_ < bytes)
        throw StateError(kvc::detail::join_message({"kvc::mpi::Source: a read of ", std::to_string(bytes),
                                                    " bytes, but the batch has ", std::to_string(batch_.size() - next_),
                                                    " left: the reads do not mirror the writes"}));
      std::memcpy(data, batch_.data() + next_, bytes);
      next_ += bytes;
    } else {
      require_batch_read(bytes);
      const detail::ErrorsReturn errors(comm_);
      auto* p = static_cast<std::byte*>(data);
      for (std::size_t got = 0; got < bytes;) {
        const std::size_t n = std::min(bytes - got, detail::max_message);
        // Straight into the destination (the K/V rows land where the cache keeps them); a longer
        // message is an MPI_ERR_TRUNCATE, a shorter one is caught by its count.
        MPI_Status status;
        detail::check(MPI_Recv(p + got, static_cast<int>(n), MPI_BYTE, peer_, tag_, comm_, &status), "MPI_Recv");
        peer_ = status.MPI_SOURCE;
        int count = 0;
        detail::check(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count");
        if (count == 0) ended_ = true;
        if (ended_) throw ended_early();
        if (static_cast<std::size_t>(count) != n)
          throw StateError(kvc::detail::join_message({"kvc::mpi::Source: expected a message of ", std::to_string(n),
                                                      " bytes, received one of ", std::to_string(count),
                                                      ": the reads do not mirror the writes"}));
        got += n;
      }
    }
    received_ += bytes;
  }

  // Receives the end of the stream; throws kvc::StateError if the sender wrote more than was
  // read (the rest is dropped first).
  void finish() {
    if (ended_) return;
    require_batch_read(0);
    const detail::ErrorsReturn errors(comm_);
    Message m = receive_message();
    if (ended_) return;
    drop(m);
    throw StateError(
        kvc::detail::join_message({"kvc::mpi::Source: the sender wrote more than was read (", std::to_string(received_),
                                   " bytes): the reads do not mirror the writes"}));
  }

  // The number of bytes still allowed to be read: max_bytes minus what was read.
  std::uint64_t available() const noexcept { return max_bytes_ - received_; }
  // The number of bytes read so far.
  std::uint64_t bytes() const noexcept { return received_; }  // bytes read so far

 private:
  struct Message {
    MPI_Message handle = MPI_MESSAGE_NULL;
    std::size_t bytes = 0;
    int count() const noexcept { return static_cast<int>(bytes); }
  };

  // Matches the next message of the stream (MPI_Mprobe: the message matched is the one later
  // received, whatever other threads do). The end marker is received here and sets ended_.
  Message receive_message() {
    Message m;
    MPI_Status status;
    detail::check(MPI_Mprobe(peer_, tag_, comm_, &m.handle, &status), "MPI_Mprobe");
    int count = 0;
    detail::check(MPI_Get_count(&status, MPI_BYTE, &count), "MPI_Get_count");
    peer_ = status.MPI_SOURCE;
    m.bytes = static_cast<std::size_t>(count);
    if (count == 0) {
      detail::check(MPI_Mrecv(nullptr, 0, MPI_BYTE, &m.handle, MPI_STATUS_IGNORE), "MPI_Mrecv");
      ended_ = true;
    }
    return m;
  }
  void drop(Message& m) {
    if (ended_) return;
    std::vector<std::byte> scratch(m.bytes);
    detail::check(MPI_Mrecv(scratch.data(), m.count(), MPI_BYTE, &m.handle, MPI_STATUS_IGNORE), "MPI_Mrecv");
  }
  void require_batch_read(std::size_t bytes) const {
    if (next_ != batch_.size())
      throw StateError(kvc::detail::join_message({"kvc::mpi::Source: a read of ", std::to_string(bytes),
                                                  " bytes while ", std::to_string(batch_.size() - next_),
                                                  " batched bytes are unread: the reads do not mirror the writes"}));
  }
  StateError ended_early() const {
    return StateError(kvc::detail::join_message({"kvc::mpi::Source: the stream ended after ", std::to_string(received_),
                                                 " bytes: the sender stopped early or wrote less than is read"}));
  }

  int peer_, tag_;
  MPI_Comm comm_;
  std::uint64_t max_bytes_, received_ = 0;
  std::vector<std::byte> batch_;
  std::size_t next_ = 0;
  bool ended_ = false;
};

// Sends `cache` to rank `dest` (write_state: the header, then every layer) and returns when every
// message has left; the cache must not change meanwhile. Pairs with receive or a LayerReceiver.
template <class Cache>
void send(const Cache& cache, int dest, int tag, MPI_Comm comm) {
  Sink sink(dest, tag, comm);
  kvc::write_state(cache, sink);
  sink.finish();
}

// Receives a cache sent by `send` into `cache`, every layer (StateLoader: the header is checked
// against `cache` first, kvc::StateError naming what differs, and the cache is unchanged). Each
// layer then keeps the strong guarantee: a failure in layer l leaves layers 0 .. l-1 received. A
// stream with more than the cache's layers (the two ends disagree) throws kvc::StateError after
// the layers were loaded.
template <class Cache>
void receive(Cache& cache, int source, int tag, MPI_Comm comm) {
  Source channel(source, tag, comm);
  kvc::StateLoader<Cache, Source> loader(cache, channel);
  if (loader.layers() > 0) loader.load_through(loader.layers() - 1);
  channel.finish();
}

// A cache received layer by layer, on demand: the constructor receives and checks the header;
// pull(l) receives the layers up to l (inclusive) that are not in the cache yet. A decode step
// calls pull(l) just before it attends with layer l, so computing starts as soon as layer 0 is in
// while the sender's later layers are still on their way. Not copyable or movable (the loader
// refers to the channel).
template <class Cache>
class LayerReceiver {
 public:
  // Receives the stream's header from rank `source` and checks it against `cache`. StateError when
  // it does not match or the stream ends; RuntimeError on an MPI error or without MPI initialized.
  LayerReceiver(Cache& cache, int source, int tag, MPI_Comm comm)
      : channel_(source, tag, comm), loader_(cache, channel_) {}
  LayerReceiver(const LayerReceiver&) = delete;
  LayerReceiver& operator=(const LayerReceiver&) = delete;

  // The number of layers in the stream.
  std::int64_t layers() const { return loader_.layers(); }  // layers in the stream
  // The number of layers received into the cache so far.
  std::int64_t loaded() const { return loader_.loaded(); }  // layers in the cache so far
  // Whether every layer of the stream is in the cache.
  bool done() const { return loaded() == layers(); }

  // Layers past the stream's last are ignored (a model layer the sender had no state for).
  void pull(std::int64_t layer) {
    if (layer >= layers()) layer = layers() - 1;
    if (layer >= loaded()) loader_.load_through(layer);
  }
  // Receives what is left, then the stream's end.
  void finish() {
    pull(layers() - 1);
    channel_.finish();
  }

  // The number of bytes received so far.
  std::uint64_t bytes() const noexcept { return channel_.bytes(); }  // bytes received so far

 private:
  Source channel_;  // declared first: loader_ holds a reference to it
  kvc::StateLoader<Cache, Source> loader_;
};

// One request of a paged cache: its blocks' K/V and its bookkeeping (write_request on this rank,
// read_request on the other).
template <class S>
void send_request(const PagedCache<S>& cache, const std::string& request_id, int dest, int tag, MPI_Comm comm) {
  Sink sink(dest, tag, comm);
  kvc::write_request(cache, request_id, sink);
  sink.finish();
}

// Loads the request under `request_id` (which `cache` must not hold); on an error in the request,
// nothing is allocated. A stream with more than the request (the two ends disagree) throws
// kvc::StateError after the request was loaded.
template <class S>
void receive_request(PagedCache<S>& cache, const std::string& request_id, int source, int tag, MPI_Comm comm) {
  Source channel(source, tag, comm);
  kvc::read_request(cache, request_id, channel);
  channel.finish();
}

// What PagedTensorParallel::min_over_ranks takes: every value replaced by its minimum over the
// ranks of `comm`, one MPI_Allreduce(MPI_MIN) on int64. Collective: every rank of `comm` must call
// it with the same number of values, as the paged cache's planner does on each TP rank.
inline std::function<void(std::span<std::int64_t>)> min_over_ranks(MPI_Comm comm) {
  return [comm](std::span<std::int64_t> values) {
    if (values.size() > static_cast<std::size_t>(INT_MAX))
      throw RuntimeError("kvc::mpi::min_over_ranks: more than INT_MAX values");
    const detail::ErrorsReturn errors(comm);
    detail::check(
        MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T, MPI_MIN, comm),
        "MPI_Allreduce");
  };
}

}  // namespace kvc::mpi
