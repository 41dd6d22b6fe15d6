// The safety rules of direct accumulation into an exposed InputBuffer slot,
// as torch 2.15 enforces them (input_buffer.cpp, Note [Direct accumulation
// thread and stream safety]), and the state they need.
//
// torch 2.15 keeps, per InputBuffer slot, the engine thread that first
// exposed it, validates every exposure against it and against the producer's
// and consumer's streams, and validates every producer that reaches the slot
// later (InputBuffer::add). Older releases have neither the state nor the
// check: the state lives here, keyed by (graph task, consumer node, slot), and
// later producers are validated by an engine hook placed on
// InputBuffer::add's call path (libtorch_cpu's GOT entry) the first time a
// buffer is exposed in a process whose engine can run nodes on more than one
// thread. A process without accelerators runs every node of a graph task on
// one thread without streams, where none of the checks can fail.
#pragma once

#include "engine_layout.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/input_buffer.h>

#include <optional>
#include <string>
#include <thread>

namespace torch_ctxext {

// Which of the rules below an accumulation breaks, with what it compared:
// the getter and the engine hook raise it as torch 2.15's text
// (refusal_message), explain() hands it to Python as fields and that message.
struct Refusal {
  enum class Kind {
    kDevice,                 // the buffer and the gradient on two devices
    kThread,                 // another engine thread than the exposing one
    kSlotStreamsUnrecorded,  // no accumulation or ready stream recorded
    kStreamsAbsent,          // accelerator: no producer or consumer stream
    kStream,                 // accelerator: the four streams differ
    kStreamsPresent,         // non-accelerator: a producer or consumer stream
  };
  Kind kind;
  c10::Device buffer_device{c10::kCPU};    // kDevice
  c10::Device gradient_device{c10::kCPU};  // kDevice
  std::thread::id exposing_thread;         // kThread
  std::thread::id accessing_thread;        // kThread
  std::optional<c10::Stream> producer;     // the stream kinds
  std::optional<c10::Stream> consumer;
  std::optional<c10::Stream> accumulation;  // kStream
  std::optional<c10::Stream> ready;         // kStream
};

// Why accumulating into slot `pos` of `buffer` (exposed on `exposing_thread`)
// from this thread, for a gradient on `device` produced on `producer` and
// consumed on `consumer`, is not allowed; nullopt when it is.
std::optional<Refusal> direct_accumulation_refusal(
    const InputBuffer& buffer, size_t pos, const c10::Device& device,
    const std::optional<c10::Stream>& producer,
    const std::optional<c10::Stream>& consumer,
    std::thread::id exposing_thread);

// torch 2.15's error text for `refusal`, verbatim (torch_ctxext's own for
// kSlotStreamsUnrecorded, which torch 2.15 cannot reach).
std::string refusal_message(const Refusal& refusal);

// Throws std::runtime_error with refusal_message when
// direct_accumulation_refusal finds one.
void validate_direct_accumulation(const InputBuffer& buffer, size_t pos,
                                  const c10::Device& device,
                                  const std::optional<c10::Stream>& producer,
                                  const std::optional<c10::Stream>& consumer,
                                  std::thread::id exposing_thread);

// Whether accumulating into a slot on `device` can be validated at all on
// this torch: not for an accelerator slot before 2.8, whose engine records no
// per-slot streams (engine_layout.h, D). Such a slot is never exposed.
bool direct_accumulation_checkable(const c10::Device& device);

// The stream the consumer node will run on: the one a stale-capture override
// recorded in its buffer, else its own (as Engine::evaluate_function picks).
std::optional<c10::Stream> consumer_stream(const InputBuffer& buffer,
                                           Node* consumer);

// The thread that first exposed slot `pos` of `consumer`'s buffer in `task`.
std::optional<std::thread::id> exposing_thread(const GraphTask* task,
                                               const Node* consumer,
                                               size_t pos);

// Record the exposure of a slot (after it was validated): the thread, for the
// checks of later exposures and producers; and, when later producers can run
// on another engine thread, the engine hook that validates them.
void record_exposure(GraphTask* task, const Node* consumer, size_t pos);

// Whether producers that reach a slot after its exposure are validated in
// this process (see above). When they cannot be (the hook could not be
// placed), a slot that still expects later producers is not exposed.
bool later_producers_validated();

// Mark `node` as having handed out a buffer while executing in `task`: until
// the task ends, a backward() or grad() called from `node`'s backward in
// that task is refused (the engine could accumulate into a buffer the
// backward is still writing). Per task, so that two threads running the
// same retained graph do not share the mark.
void mark_exposed(GraphTask* task, const Node* node);
bool exposed_in(const GraphTask* task, const Node* node);

// For tests: how many producers the engine hook validated, whether it is
// placed, and a way to place it on a machine without accelerators.
uint64_t validated_later_producers();
bool producer_hook_placed();
void place_producer_hook();

// Binds the functions for tests above into torch_ctxext._C._testing
// (module.cpp); nothing of this file is bound into _C itself.
void register_direct_accumulation(pybind11::module_& m, pybind11::module_& testing);

}  // namespace torch_ctxext
