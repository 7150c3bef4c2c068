#pragma once
// The step channel's shared-memory layout: one home for the offsets that the
// daemon (server/daemon/step_channel.cc) and the clients
// (client/cpp/step_channel.cc; Python's muond/step_channel.py through
// muond/_rules.py) share. All fields little-endian; a u32 field is naturally
// aligned. See docs/ARCHITECTURE.md "The step channel".
//
// The trainer creates a POSIX shm object of
// kRequestOffset + request_capacity + response_capacity bytes, writes the
// header and names it in OpenStepChannel. A step is then:
//   trainer: request bytes (a StepRequest) at kRequestOffset, request_len,
//            request_op, then request_seq + 1 and FUTEX_WAKE(request_seq);
//   daemon:  reads them with pread (never through a mapping: a trainer that
//            shrinks the object cannot SIGBUS the daemon), answers at
//            ResponseOffset(), response_len and response_kind, then
//            response_seq = request_seq and FUTEX_WAKE(response_seq).
// A request with StepRequest.await_trainer_verdict: before its job vote the
// daemon waits until verdict_seq == request_seq, the trainer having written
// verdict (kVerdictGo or kVerdictWithdraw), then verdict_seq, then
// FUTEX_WAKE(verdict_seq). A verdict written before the daemon reads its
// request counts once it does. Other requests never read them.
// Liveness: each side holds an open-file-description lock (F_OFD_SETLK) on
// one byte of the object (kTrainerLockByte, kDaemonLockByte) and tests the
// other's with F_OFD_GETLK; the kernel drops a lock when its process dies.
#include <fcntl.h>

#include <cstdint>

namespace muond::step_channel {

inline constexpr uint64_t kMagic = 0x314843444E4F554DULL;  // "MUONDCH1"
inline constexpr uint32_t kVersion = 1;

// Header fields (byte offsets).
inline constexpr uint64_t kMagicOffset = 0;              // u64
inline constexpr uint64_t kVersionOffset = 8;            // u32
inline constexpr uint64_t kRequestCapacityOffset = 12;   // u32
inline constexpr uint64_t kResponseCapacityOffset = 16;  // u32
// The futex words, each on its own cache line.
inline constexpr uint64_t kRequestSeqOffset = 64;     // u32, trainer writes
inline constexpr uint64_t kResponseSeqOffset = 128;   // u32, daemon writes
inline constexpr uint64_t kRequestLenOffset = 192;    // u32, trainer writes
inline constexpr uint64_t kRequestOpOffset = 196;     // u32, trainer writes
inline constexpr uint64_t kResponseLenOffset = 256;   // u32, daemon writes
inline constexpr uint64_t kResponseKindOffset = 260;  // u32, daemon writes
inline constexpr uint64_t kVerdictSeqOffset = 320;    // u32, trainer writes
inline constexpr uint64_t kVerdictOffset = 384;       // u32, trainer writes
inline constexpr uint64_t kRequestOffset = 4096;      // the request area

inline constexpr uint64_t ResponseOffset(uint32_t request_capacity) {
  return kRequestOffset + request_capacity;
}

// Lock bytes (F_OFD_SETLK ranges of length 1; they need no backing).
inline constexpr uint64_t kTrainerLockByte = 0;
inline constexpr uint64_t kDaemonLockByte = 1;

// The F_OFD_SETLK / F_OFD_GETLK range of one lock byte.
inline struct flock OneByte(short type, uint64_t byte) {
  struct flock lock = {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  lock.l_start = static_cast<off_t>(byte);
  lock.l_len = 1;
  return lock;
}

// Whether another open file description holds a lock on `byte`: each side's
// lock lives exactly as long as its process (or a fork of it). A failed test
// counts as not held.
inline bool LockHeldByOther(int fd, uint64_t byte) {
  struct flock lock = OneByte(F_WRLCK, byte);
  if (fcntl(fd, F_OFD_GETLK, &lock) != 0) return false;
  return lock.l_type != F_UNLCK;
}

// Each area: a multiple of 4096 bytes, at least 64 KiB (any refusal fits:
// its message is cut to server/common/grpc_status.h's wire budget) and at
// most 64 MiB.
inline constexpr uint32_t kMinCapacity = 64u << 10;
inline constexpr uint32_t kMaxCapacity = 64u << 20;

enum RequestOp : uint32_t {
  kOpStep = 1,   // the request area holds a StepRequest
  kOpClose = 2,  // the trainer closes the channel (no answer)
};

enum ResponseKind : uint32_t {
  kStepResponse = 1,  // the response area holds a StepResponse
  kRpcStatus = 2,     // ... a muond.v1.RpcStatus: the step failed as over gRPC
  // The step's answer (applied, or refused) did not fit response_capacity:
  // response_len holds its size; the trainer sends the same request over
  // gRPC, which returns that answer as it was (the daemon keeps it:
  // OpenStepChannelResponse.answers_kept; an older daemon answers from its
  // record of the step, StepResponse.replayed).
  kTooLarge = 3,
};

// The trainer's verdict on a step sent before its checks.
enum Verdict : uint32_t {
  kVerdictGo = 1,        // commit it
  kVerdictWithdraw = 2,  // refuse it on every rank; it is sent again
};

}  // namespace muond::step_channel
