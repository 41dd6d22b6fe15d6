#include "advise_watch.h"

#include "ctx_node.h"

#include <pybind11/stl.h>

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <typeinfo>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch_ctxext {
namespace {

using torch::autograd::variable_list;
// std::shared_ptr<Node> up to 2.12, c10::intrusive_ptr<Node> from 2.13.
using NodeRef = decltype(torch::autograd::Edge::function);

// What a producer left in a slot. Python sees graph.py's kinds (its
// NOTHING, GRADIENT, FUSED, handed over by name in the crossing): these are
// only indices into them.
enum Kind : uint8_t { kNothing = 0, kGradient = 1, kFused = 2, kKinds = 3 };

// One producer's arrival in a slot: graph.Arrival on the Python side.
struct Arrival {
  int32_t producer;  // its index among the slot's producers
  uint8_t kind;
  bool stock_view;  // a drop-in's gradient where the stock module's is a view
  int64_t bytes;    // the extent the gradient's strides span

  bool operator==(const Arrival& o) const {
    return producer == o.producer && kind == o.kind && stock_view == o.stock_view && bytes == o.bytes;
  }
};

// One slot of graph.Backward.outcome(): its arrivals, whether the engine
// summed out of place, the gradient's bytes (if known).
struct SlotOutcome {
  std::vector<Arrival> arrivals;
  bool out_of_place = false;
  bool has_bytes = false;
  int64_t bytes = 0;

  bool operator==(const SlotOutcome& o) const {
    return arrivals == o.arrivals && out_of_place == o.out_of_place && has_bytes == o.has_bytes &&
           (!has_bytes || bytes == o.bytes);
  }
};

// What reached one slot in a backward: graph.Outcome on the Python side.
struct SlotRecord {
  std::vector<Arrival> arrivals;
  bool given = false;  // a gradient has arrived
  bool has_first = false;
  uintptr_t first_address = 0;
  int64_t first_bytes = 0;  // numel x element size of the first gradient
  bool has_final = false;
  uintptr_t final_address = 0;
};

// The Python types the fields cross as (graph.py's named tuples) and its
// kinds, read by name from the crossing object graph.py passes (CROSSING):
// each field is named on both sides, each number written in Python alone.
struct Crossing {
  explicit Crossing(py::handle crossing) {
    found = type_of(crossing, "Found", 7);
    producer = type_of(crossing, "Producer", 4);
    outcome = type_of(crossing, "Outcome", 5);
    arrival = type_of(crossing, "Arrival", 4);
    kinds[kNothing] = crossing.attr("NOTHING");
    kinds[kGradient] = crossing.attr("GRADIENT");
    kinds[kFused] = crossing.attr("FUSED");
  }

  // A tuple subclass of `fields` fields (a named tuple), as `name`.
  static py::object type_of(py::handle crossing, const char* name, size_t fields) {
    py::object type = crossing.attr(name);
    if (!PyType_Check(type.ptr()) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type.ptr()), &PyTuple_Type) ||
        py::len(type.attr("_fields")) != fields) {
      throw py::type_error(std::string("advise_watch: the crossing's ") + name + " must be a named tuple of " +
                           std::to_string(fields) + " fields");
    }
    return type;
  }

  // An instance of the named tuple `type` of these values, made as
  // tuple.__new__(type, values) makes it (no Python __new__ runs).
  static py::object make(const py::object& type, py::tuple values) {
    py::tuple args(1);
    PyTuple_SET_ITEM(args.ptr(), 0, values.release().ptr());
    PyObject* made = PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(type.ptr()), args.ptr(), nullptr);
    if (made == nullptr) {
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(made);
  }

  py::object found, producer, outcome, arrival;
  py::object kinds[kKinds];
};

// The crossing's types, read once per crossing object: graph.py hands every
// watch the same constant class, and reading its seven names again at each
// backward was half of the watch's constructor on a small graph. Called
// with the GIL (the watch is made from Python).
std::shared_ptr<const Crossing> crossing_of(py::handle crossing) {
  struct Last {
    py::object object;  // held: its address names no other object while cached
    std::shared_ptr<const Crossing> read;
  };
  static auto* const last = new Last();  // never freed: outlives Python
  if (!last->read || last->object.ptr() != crossing.ptr()) {
    auto read = std::make_shared<const Crossing>(crossing);  // a refused crossing leaves the last
    last->object = py::reinterpret_borrow<py::object>(crossing);
    last->read = std::move(read);
  }
  return last->read;
}

// The address of a gradient's data (Tensor.data_ptr()), if it has one.
bool address_of(const at::Tensor& t, uintptr_t& address) {
  try {
    if (!t.has_storage()) {
      return false;
    }
    address = reinterpret_cast<uintptr_t>(t.data_ptr());
    return true;
  } catch (...) {
    return false;
  }
}

// graph.py's storage_bytes: the extent a gradient's strides span (less than
// its elements for an expanded one), from sizes and strides only.
int64_t storage_bytes(const at::Tensor& t) {
  const int64_t numel = t.numel();
  const int64_t element = static_cast<int64_t>(t.element_size());
  if (numel == 0) {
    return 0;
  }
  try {
    if (t.is_contiguous()) {
      return numel * element;
    }
  } catch (...) {
  }
  int64_t span = numel;
  try {
    if (t.layout() == c10::kStrided) {
      const auto sizes = t.sizes();
      const auto strides = t.strides();
      span = 1;
      for (size_t i = 0; i < sizes.size(); ++i) {
        span += (sizes[i] - 1) * std::llabs(strides[i]);
      }
    }
  } catch (...) {  // a layout without strides
    span = numel;
  }
  return std::min(span, numel) * element;
}

// The slots of one watched backward and what reached them. The hooks fill it
// on the engine's threads, without the GIL; Python reads it when the
// backward is over.
struct Record {
  std::mutex mutex;
  std::atomic<bool> armed{true};
  // Compiled autograd asked a hook for its compiled_args: it will not call
  // the hook, so this backward's arrivals were not seen.
  std::atomic<bool> compiled{false};
  std::vector<SlotRecord> slots;
  std::string error;  // the first failure to read a gradient, if any

  void arrive(size_t slot, int32_t producer, const at::Tensor* gradient,
              uint8_t kind_without_gradient, bool stock_view) {
    std::lock_guard<std::mutex> lock(mutex);
    arrive_locked(slot, producer, gradient, kind_without_gradient, stock_view);
  }

  // arrive(), with `mutex` held (a hook that fills several slots takes it once).
  void arrive_locked(size_t slot, int32_t producer, const at::Tensor* gradient,
                     uint8_t kind_without_gradient, bool stock_view) {
    auto& s = slots[slot];
    if (gradient == nullptr || !gradient->defined()) {
      s.arrivals.push_back({producer, kind_without_gradient, false, 0});
      return;
    }
    try {
      if (!s.given) {
        s.given = true;
        s.has_first = address_of(*gradient, s.first_address);
        s.first_bytes = gradient->numel() * static_cast<int64_t>(gradient->element_size());
      }
      s.arrivals.push_back({producer, kGradient, stock_view, storage_bytes(*gradient)});
    } catch (const std::exception& e) {  // never into the training step
      if (error.empty()) {
        error = e.what();
      }
    }
  }

  void finished(size_t slot, const at::Tensor& buffer) {
    std::lock_guard<std::mutex> lock(mutex);
    auto& s = slots[slot];
    s.has_final = buffer.defined() && address_of(buffer, s.final_address);
  }
};

struct ProducerEntry {
  size_t slot;
  int32_t producer;
  size_t position;  // the index of the node's output (next edge) feeding the slot
};
// A node's entries: most nodes produce for one slot, or two (no allocation).
using ProducerEntries = c10::SmallVector<ProducerEntry, 2>;
using ConsumerSlots = c10::SmallVector<std::pair<size_t, uint32_t>, 2>;

// What both hooks share: the record they fill, and what they tell compiled
// autograd. Compiled autograd does not call a C++ hook: instead of raising
// (its default) into the step, the record notes that it was asked, and the
// report says so. Python chooses Python hooks where compiled autograd is on
// (graph.py); this covers what that check cannot see. Both signatures: the
// method is const from torch 2.7.
template <typename Hook>
struct RecordingHook : Hook {
  explicit RecordingHook(std::shared_ptr<Record> record) : record(std::move(record)) {}

  bool armed() const { return record->armed.load(std::memory_order_acquire); }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const {
    record->compiled.store(true);
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) {
    record->compiled.store(true);
  }

  std::shared_ptr<Record> record;
};

// On a built-in producer: sees the gradients it returns.
struct ProducerHook : RecordingHook<torch::autograd::FunctionPostHook> {
  ProducerHook(std::shared_ptr<Record> record, ProducerEntries entries)
      : RecordingHook(std::move(record)), entries(std::move(entries)) {}

  variable_list operator()(const variable_list& outputs,
                           const variable_list& /*inputs*/) override {
    if (armed()) {
      std::lock_guard<std::mutex> lock(record->mutex);
      for (const auto& e : entries) {
        record->arrive_locked(e.slot, e.producer,
                              e.position < outputs.size() ? &outputs[e.position] : nullptr,
                              kNothing, false);
      }
    }
    return outputs;
  }

  ProducerEntries entries;
};

// On a consumer: sees each watched slot's finished buffer.
struct ConsumerHook : RecordingHook<torch::autograd::FunctionPreHook> {
  ConsumerHook(std::shared_ptr<Record> record, ConsumerSlots slots)
      : RecordingHook(std::move(record)), slots(std::move(slots)) {}

  variable_list operator()(const variable_list& grads) override {
    if (armed()) {
      for (const auto& [slot, nr] : slots) {
        if (nr < grads.size()) {
          record->finished(slot, grads[nr]);
        }
      }
    }
    return grads;
  }

  ConsumerSlots slots;
};

// A finished watch's hooks stay on their nodes (disarmed: one atomic load if
// a retained graph runs again): taking them off when the backward ends could
// race with another thread's backward over the same retained graph, which
// iterates the node's hooks without a lock. They are taken off here instead,
// when a later watch places its own on the same node, where torch's own
// registration mutates the same vector.
template <typename Hook, typename Hooks>
void drop_disarmed(Hooks& hooks) {
  hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                             [](const auto& hook) {
                               const auto* ours = dynamic_cast<const Hook*>(hook.get());
                               return ours != nullptr && !ours->armed();
                             }),
              hooks.end());
}

struct SlotKey {
  Node* node;
  uint32_t nr;
  bool operator==(const SlotKey& o) const { return node == o.node && nr == o.nr; }
};
struct SlotKeyHash {
  size_t operator()(const SlotKey& k) const {
    return std::hash<const void*>()(k.node) ^ (static_cast<size_t>(k.nr) * 0x9e3779b97f4a7c15ULL);
  }
};

// One entry of a backward's shape (graph.py's _shape): a slot's (count >= 0:
// its producers) or a producer's.
struct ShapeEntry {
  py::object op;
  bool has_seq;
  int64_t seq;
  uint32_t nr;
  int64_t count;
};

struct Producer {
  Node* node;  // nullptr: the backward's root gradient number `position`
  size_t position;
};

const std::string kAccumulateGrad = "torch::autograd::AccumulateGrad";

// graph.py's _metadata_bytes: the bytes of the gradient the engine expects
// for input `nr` of `node` (numel x element size, by the node's input
// metadata), or None where the metadata cannot say (a nested or symbolic
// shape, an undefined input): into `bytes`, false where it cannot say.
bool metadata_bytes_of(const Node& node, uint32_t nr, int64_t& bytes) {
  try {
    if (nr >= node.num_inputs()) {
      return false;
    }
    const auto& meta = node.input_metadata(nr);
    if (meta.was_default_constructed() || meta.is_nested_tensor()) {
      return false;
    }
    int64_t numel = 1;
    for (const auto& size : meta.shape_as_dim_vector()) {
      const auto value = size.maybe_as_int();
      if (!value) {
        return false;
      }
      numel *= *value;
    }
    bytes = numel * static_cast<int64_t>(meta.dtype().itemsize());
    return true;
  } catch (...) {
    return false;
  }
}

// The same as a Python int, or None.
py::object metadata_bytes(const Node& node, uint32_t nr) {
  int64_t bytes = 0;
  return metadata_bytes_of(node, nr, bytes) ? py::object(py::int_(bytes)) : py::object(py::none());
}

// Whether a node is a custom Function's (torch's PyNode), without making a
// Python object for it: by its dynamic type's name, as PyNode's type_info is
// not exported from libtorch_python (from 2.9) for a typeid comparison.
bool is_python_function(const Node* node) {
  static constexpr const char* kPyNode = "N5torch8autograd6PyNodeE";
  const char* name = typeid(*node).name();
  return std::strcmp(name + (name[0] == '*'), kPyNode) == 0;
}

// A node's op (Node::name()) as a Python str, and whether it is a leaf's
// AccumulateGrad. Node::name() demangles the node's type name at every call,
// which on a graph of small ops was most of the walk's time: it is kept per
// type, for the process (read and filled under the GIL). A custom
// Function's node (PyNode) is named by its Python class: asked each time.
struct OpName {
  py::object name;
  bool leaf;
};

OpName op_name(const Node* node) {
  // Keyed by the address of the type's name (std::type_index hashes the
  // name's characters at every lookup); a type whose name is at two
  // addresses (two libraries) has two entries.
  static auto* const names = new ska::flat_hash_map<const char*, OpName>();  // never freed: outlives Python
  if (is_python_function(node)) {
    return OpName{py::str(node->name()), false};
  }
  const char* type = typeid(*node).name();
  auto it = names->find(type);
  if (it == names->end()) {
    const std::string name = node->name();
    it = names->emplace(type, OpName{py::str(name), name == kAccumulateGrad}).first;
  }
  return it->second;
}

// The node a Python node object stands for (a built-in node, or the ctx of a
// custom Function), or nullptr.
Node* node_from_python(PyObject* obj) {
  if (torch::autograd::THPCppFunction_Check(obj)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get();
  }
  if (is_ctx(obj)) {
    return node_of(reinterpret_cast<THPFunction*>(obj));
  }
  return nullptr;
}

// One edge a backward starts from (or an inputs= edge): its node, input
// number, and what holds the node while the watch is made: the Python node
// object given, or the reference read from a tensor.
struct GivenEdge {
  Node* node;
  uint32_t nr;
  py::handle object;  // the node object given, or null
  NodeRef ref;  // the tensor's gradient edge's node, where a tensor was given
};

// [a Tensor, a (node object, nr) pair (a GradientEdge), or None] -> their
// edges (node nullptr where None, or a tensor that requires no gradient).
// A tensor's edge is the engine's own (its grad_fn, or a leaf's gradient
// accumulator): no Python node object is made for it, which cost more than
// a small graph's walk.
std::vector<GivenEdge> edges_from_python(const py::sequence& edges) {
  std::vector<GivenEdge> out;
  out.reserve(edges.size());
  for (const auto& item : edges) {
    if (item.is_none()) {
      out.push_back({nullptr, 0, py::handle(), NodeRef()});
      continue;
    }
    if (THPVariable_Check(item.ptr())) {
      auto edge = torch::autograd::impl::gradient_edge(THPVariable_Unpack(item.ptr()));
      Node* node = edge.function.get();
      out.push_back({node, node != nullptr ? edge.input_nr : 0, py::handle(), std::move(edge.function)});
      continue;
    }
    auto pair = item.cast<py::tuple>();
    py::handle obj = pair[0];
    Node* node = node_from_python(obj.ptr());
    if (node == nullptr) {
      throw py::type_error("advise_watch: an edge's node is not an autograd node");
    }
    out.push_back({node, pair[1].cast<uint32_t>(), obj, NodeRef()});
  }
  return out;
}

class Watch {
 public:
  Watch(const py::sequence& roots, const py::sequence& inputs, py::handle crossing, bool keep_nodes,
        py::handle grad_tensors)
      : record_(std::make_shared<Record>()), crossing_(crossing_of(crossing)) {
    roots_ = edges_from_python(roots);
    walk(roots_);
    const auto input_edges = edges_from_python(inputs);
    const bool restricted = !input_edges.empty();
    ska::flat_hash_set<Node*> running;
    auto runs = [&](Node* node) { return !restricted || running.count(node) != 0; };
    if (restricted) {
      // Only the producers that run count (a root's gradient always does).
      running = leading_to(input_edges);
      counts_.clear();
      for (const auto& edge : edges_) {
        if (runs(edge.key.node) && (edge.producer.node == nullptr || runs(edge.producer.node))) {
          ++counts_[edge.key];
        }
      }
    }
    // Slots (two or more producers, of the nodes that run), in the order
    // their first edge was found (graph.py's walk); their producers in the
    // order their edges were.
    ska::flat_hash_map<SlotKey, size_t, SlotKeyHash> slot_of;
    std::vector<std::pair<SlotKey, std::vector<Producer>>> slots;
    for (const auto& edge : edges_) {
      const auto count = counts_.find(edge.key);
      if (count == counts_.end() || count->second < 2) {
        continue;
      }
      auto [it, inserted] = slot_of.emplace(edge.key, slots.size());
      if (inserted) {
        slots.emplace_back(edge.key, std::vector<Producer>{});
      }
      if (edge.producer.node == nullptr || runs(edge.producer.node)) {
        slots[it->second].second.push_back(edge.producer);
      }
    }
    // The walk's edges are not needed past here (they name every edge).
    edges_ = {};
    counts_ = {};
    record_->slots.resize(slots.size());
    arrive_roots(slots, grad_tensors);
    hook(std::move(slots));
    if (!keep_nodes) {  // contains() is asked only where keep_nodes
      refs_ = {};
    }
    root_objects_.clear();
    roots_.clear();
  }

  // A watch Python drops unfinished (its backward failed to start) stops
  // recording: its hooks stay on the nodes, disarmed, for the next to sweep.
  ~Watch() { finish(); }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  // The Python view of the slots (graph.Found each), made at the first read.
  py::list slots() {
    if (!python_slots_) {
      make_python_slots();
    }
    return python_slots_;
  }

  // How many of the slots' producers are custom Functions (Python names
  // them, and engine.py's apply wrapper sees what they return).
  size_t functions() const { return functions_; }

  // How many of the nodes the walk reached are custom Functions' (producers
  // or not): advise() wraps their apply only for a graph that has one
  // (engine.py), and a graph without one runs no Python in its backward.
  size_t python_nodes() const { return python_nodes_; }

  // The tensor of each slot that is a leaf's, in the slots' order (the
  // Found's consumer.variable, without the view).
  py::list leaves() const {
    py::list out;
    for (const auto& held : held_) {
      if (const at::Tensor* leaf = leaf_of(held.node)) {
        out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(*leaf)));
      }
    }
    return out;
  }

  // graph.Backward.outcome(), read from the record without the Python view:
  // per slot (its arrivals as (producer, kind, bytes, stock_view), whether
  // the engine summed out of place, the gradient's bytes: a leaf's by its
  // tensor, else by the consumer's metadata, else the first gradient's, or
  // None). Equal (and equally hashed) to Python's, whose arrivals are
  // graph.Arrival named tuples of the same fields.
  py::tuple outcome() const {
    // Read under the lock, made into Python objects after.
    std::vector<SlotOutcome> now(slots_.size());
    {
      std::lock_guard<std::mutex> lock(record_->mutex);
      for (size_t i = 0; i < slots_.size(); ++i) {
        const auto& s = record_->slots[i];
        auto& o = now[i];
        o.arrivals = s.arrivals;
        o.out_of_place = s.has_first && s.has_final && s.final_address != s.first_address;
        const auto& key = slots_[i].first;
        if (const at::Tensor* leaf = leaf_of(key.node)) {
          o.has_bytes = true;
          o.bytes = leaf->numel() * static_cast<int64_t>(leaf->element_size());
        } else if (metadata_bytes_of(*key.node, key.nr, o.bytes)) {
          o.has_bytes = true;
        } else if (s.given) {
          o.has_bytes = true;
          o.bytes = s.first_bytes;
        }
      }
    }
    // A training loop's steps see equal outcomes: the last one's tuple is
    // handed out again (compared by identity in advise()'s lookup).
    struct LastOutcome {
      std::vector<SlotOutcome> slots;
      PyObject* kinds[kKinds] = {};
      py::object tuple;
    };
    static auto* const last = new LastOutcome();  // never freed: outlives Python
    bool same = last->tuple && last->slots == now;
    for (size_t k = 0; same && k < kKinds; ++k) {
      same = last->kinds[k] == crossing_->kinds[k].ptr();
    }
    if (same) {
      return py::reinterpret_borrow<py::tuple>(last->tuple);
    }
    py::tuple out(now.size());
    for (size_t i = 0; i < now.size(); ++i) {
      const auto& o = now[i];
      py::tuple arrivals(o.arrivals.size());
      for (size_t j = 0; j < o.arrivals.size(); ++j) {
        const auto& a = o.arrivals[j];
        arrivals[j] = py::make_tuple(a.producer, crossing_->kinds[a.kind], a.bytes, a.stock_view);
      }
      out[i] = py::make_tuple(std::move(arrivals), o.out_of_place,
                              o.has_bytes ? py::object(py::int_(o.bytes)) : py::object(py::none()));
    }
    last->slots = std::move(now);
    for (size_t k = 0; k < kKinds; ++k) {
      last->kinds[k] = crossing_->kinds[k].ptr();
    }
    last->tuple = out;
    return out;
  }

  // graph.py's _shape of the slots, (lowest, flat tuple), made by the walk;
  // None where a custom Function produces (Python names it: graph.py shapes).
  py::object shape() const { return shape_; }

  void arrive(size_t slot, int32_t producer, py::handle gradient, bool fused, bool stock_view) {
    if (slot >= record_->slots.size()) {
      throw py::index_error("advise_watch: no such slot");
    }
    const uint8_t without = fused ? kFused : kNothing;
    if (gradient.is_none()) {
      record_->arrive(slot, producer, nullptr, without, false);
    } else if (THPVariable_Check(gradient.ptr())) {
      record_->arrive(slot, producer, &THPVariable_Unpack(gradient.ptr()), without, stock_view);
    } else {
      throw py::type_error("advise_watch: a gradient must be a Tensor or None");
    }
  }

  void finish() { record_->armed.store(false, std::memory_order_release); }

  // What Python reads of the walk as the watch is made, in one call (each
  // read from Python goes through pybind11's dispatcher, which a small
  // graph's backward pays in misses more than in work): how many slots,
  // python_nodes(), functions(), shape().
  py::tuple walked() const { return py::make_tuple(slots_.size(), python_nodes_, functions_, shape_); }

  // finish(), then what kept the backward from being seen, in one call:
  // (compiled(), error()).
  py::tuple close() {
    finish();
    return py::make_tuple(compiled(), error());
  }

  // Whether the node `obj` stands for (a built-in node or a ctx) is one the
  // walk reached (a watch made with keep_nodes; the nodes are alive while
  // their backward runs, which is when this is asked).
  bool contains(py::handle obj) const {
    Node* node = node_from_python(obj.ptr());
    return node != nullptr && refs_.count(node) != 0;
  }

  // Whether a gradient has reached the slot yet.
  bool given(size_t slot) const {
    if (slot >= record_->slots.size()) {
      throw py::index_error("advise_watch: no such slot");
    }
    std::lock_guard<std::mutex> lock(record_->mutex);
    return record_->slots[slot].given;
  }

  // Per slot, what reached it: a graph.Outcome (its arrivals, in order, as
  // graph.Arrival; whether a gradient came; the first gradient's address
  // and the finished buffer's, or None; the first gradient's bytes).
  py::list results() const {
    std::lock_guard<std::mutex> lock(record_->mutex);
    py::list out(record_->slots.size());
    size_t i = 0;
    for (const auto& s : record_->slots) {
      py::list arrivals(s.arrivals.size());
      size_t j = 0;
      for (const auto& a : s.arrivals) {
        arrivals[j++] = Crossing::make(crossing_->arrival,
                                       py::make_tuple(a.producer, crossing_->kinds[a.kind], a.bytes, a.stock_view));
      }
      out[i++] = Crossing::make(
          crossing_->outcome,
          py::make_tuple(std::move(arrivals), s.given,
                         s.has_first ? py::object(py::int_(s.first_address)) : py::object(py::none()),
                         s.has_final ? py::object(py::int_(s.final_address)) : py::object(py::none()),
                         s.first_bytes));
    }
    return out;
  }

  bool compiled() const { return record_->compiled.load(); }

  py::object error() const {
    std::lock_guard<std::mutex> lock(record_->mutex);
    return record_->error.empty() ? py::object(py::none()) : py::object(py::str(record_->error));
  }

 private:
  // Every edge goes into one flat list, each slot's producers counted in an
  // open-addressing map: a list per edge (most have one producer) and a
  // node-based map cost more in allocations than the walk itself.
  void add_edge(Node* consumer, uint32_t nr, Producer producer) {
    const SlotKey key{consumer, nr};
    edges_.push_back({key, producer});
    ++counts_[key];
  }

  // graph.py's _walk, in the same order (depth first from the last root,
  // edges in order): the slots and their producers come out as Python's did.
  void walk(const std::vector<GivenEdge>& roots) {
    // Sized as the last walk's graph (a training loop's steps walk graphs
    // of one size): growing the tables as the walk goes was a fifth of it.
    static std::atomic<size_t> last_edges{0}, last_nodes{0};
    edges_.reserve(last_edges.load(std::memory_order_relaxed));
    counts_.reserve(last_edges.load(std::memory_order_relaxed));
    refs_.reserve(last_nodes.load(std::memory_order_relaxed));
    std::vector<Node*> stack;
    for (size_t k = 0; k < roots.size(); ++k) {
      const auto& root = roots[k];
      Node* node = root.node;
      if (node == nullptr) {
        continue;
      }
      add_edge(node, root.nr, Producer{nullptr, k});
      // A root's node is held by what was given (roots_, until constructed).
      if (refs_.emplace(node, root.object ? nullptr : &root.ref).second) {
        if (root.object) {
          root_objects_.emplace(node, root.object);
        }
        stack.push_back(node);
        python_nodes_ += is_python_function(node);
      }
    }
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      const auto& edges = node->next_edges();
      for (size_t i = 0; i < edges.size(); ++i) {
        const auto& edge = edges[i];
        Node* child = edge.function.get();
        if (child == nullptr) {
          continue;
        }
        add_edge(child, edge.input_nr, Producer{node, i});
        if (refs_.emplace(child, &edge.function).second) {
          stack.push_back(child);
          python_nodes_ += is_python_function(child);
        }
      }
    }
    last_edges.store(edges_.size(), std::memory_order_relaxed);
    last_nodes.store(refs_.size(), std::memory_order_relaxed);
  }

  // graph.py's _leading_to: with inputs= the engine runs only the nodes on a
  // path to an input.
  ska::flat_hash_set<Node*> leading_to(const std::vector<GivenEdge>& inputs) {
    ska::flat_hash_map<Node*, std::vector<Node*>> parents;
    for (const auto& edge : edges_) {
      if (edge.producer.node != nullptr) {
        parents[edge.key.node].push_back(edge.producer.node);
      }
    }
    ska::flat_hash_set<Node*> running;
    std::vector<Node*> queue;
    for (const auto& input : inputs) {
      if (input.node != nullptr && running.insert(input.node).second) {
        queue.push_back(input.node);
      }
    }
    while (!queue.empty()) {
      Node* node = queue.back();
      queue.pop_back();
      auto found = parents.find(node);
      if (found == parents.end()) {
        continue;
      }
      for (Node* producer : found->second) {
        if (running.insert(producer).second) {
          queue.push_back(producer);
        }
      }
    }
    return running;
  }

  // A C++ hook on every built-in producer and every consumer (custom
  // Functions are seen by the apply wrapper: engine.py, which calls
  // arrive()), and the slots' shape. The Python view of the slots (slots())
  // is made only where it is read: a training loop's repeated step reads
  // its shape, leaves() and outcome() alone. What that view names is held
  // (held_) until then.
  void hook(std::vector<std::pair<SlotKey, std::vector<Producer>>>&& slots) {
    ska::flat_hash_map<Node*, ProducerEntries> posts;
    std::vector<Node*> post_order;
    ska::flat_hash_map<Node*, ConsumerSlots> pres;
    std::vector<Node*> pre_order;
    const py::str root_name("root gradient");
    // graph.py's _shape, in the same order: per slot its op, input number,
    // node number and producer count, then each producer's op and number
    // (numbers made relative to the lowest below). Left to Python where a
    // custom Function produces (Python names it).
    std::vector<ShapeEntry> shape;
    size_t entries = slots.size();
    for (const auto& slot : slots) {
      entries += slot.second.size();
    }
    shape.reserve(entries);
    held_.reserve(slots.size());
    for (size_t s = 0; s < slots.size(); ++s) {
      const auto& [key, producers] = slots[s];
      const OpName op = op_name(key.node);
      held_.push_back(hold(key.node));
      shape.push_back({op.name, !op.leaf, op.leaf ? 0 : static_cast<int64_t>(key.node->sequence_nr()), key.nr,
                       static_cast<int64_t>(producers.size())});
      for (size_t p = 0; p < producers.size(); ++p) {
        const auto& producer = producers[p];
        if (producer.node == nullptr) {
          shape.push_back({root_name, false, 0, 0, -1});
          continue;
        }
        if (is_python_function(producer.node)) {  // seen by engine.py's apply wrapper
          ++functions_;
          if (held_functions_.find(producer.node) == held_functions_.end()) {
            held_functions_.emplace(producer.node, hold(producer.node));
          }
          continue;
        }
        const OpName producer_op = op_name(producer.node);
        shape.push_back({producer_op.name, true, static_cast<int64_t>(producer.node->sequence_nr()), 0, -1});
        auto& entries = posts[producer.node];
        if (entries.empty()) {
          post_order.push_back(producer.node);
        }
        entries.push_back({s, static_cast<int32_t>(p), producer.position});
      }
      record_->slots[s].arrivals.reserve(producers.size());
      auto& consumer_slots = pres[key.node];
      if (consumer_slots.empty()) {
        pre_order.push_back(key.node);
      }
      consumer_slots.emplace_back(s, key.nr);
    }
    if (functions_ == 0) {
      make_shape(shape);
    }
    for (Node* node : post_order) {
      drop_disarmed<ProducerHook>(node->post_hooks());
      node->add_post_hook(std::make_unique<ProducerHook>(record_, std::move(posts[node])));
    }
    for (Node* node : pre_order) {
      drop_disarmed<ConsumerHook>(node->pre_hooks());
      node->add_pre_hook(std::make_unique<ConsumerHook>(record_, std::move(pres[node])));
    }
    slots_ = std::move(slots);
  }

  // A node the Python view names, held: a root's Python object (given), or
  // a strong reference to the node (its Python object is made only if the
  // view is).
  struct Held {
    Node* node;
    NodeRef ref;
    py::object root;
  };

  Held hold(Node* node) {
    auto root = root_objects_.find(node);
    if (root != root_objects_.end()) {
      return Held{node, NodeRef(), py::reinterpret_borrow<py::object>(root->second)};
    }
    return Held{node, *refs_.at(node), py::object()};
  }

  static py::object python_object(const Held& held) {
    if (held.root) {
      return held.root;
    }
    PyObject* obj = torch::autograd::functionToPyObject(held.ref);
    if (obj == nullptr) {
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(obj);
  }

  // The Python view of the slots, a graph.Found each (its consumer, input,
  // producers as graph.Producer, op, number: None for a leaf's, the
  // gradient's bytes by its metadata or None, how many producers are custom
  // Functions; a producer's node only for a custom Function's, its op None:
  // Python names it; ("root gradient", None, None, k) for a root).
  void make_python_slots() {
    const py::str root_name("root gradient");
    py::list out(slots_.size());
    for (size_t s = 0; s < slots_.size(); ++s) {
      const auto& [key, producers] = slots_[s];
      const OpName op = op_name(key.node);
      py::list python_producers(producers.size());
      size_t functions = 0;
      for (size_t p = 0; p < producers.size(); ++p) {
        const auto& producer = producers[p];
        py::tuple values;
        if (producer.node == nullptr) {
          values = py::make_tuple(root_name, py::none(), py::none(), producer.position);
        } else if (is_python_function(producer.node)) {
          ++functions;
          values = py::make_tuple(py::none(), producer.node->sequence_nr(),
                                  python_object(held_functions_.at(producer.node)), producer.position);
        } else {
          values = py::make_tuple(op_name(producer.node).name, producer.node->sequence_nr(), py::none(),
                                  producer.position);
        }
        python_producers[p] = Crossing::make(crossing_->producer, std::move(values));
      }
      // A leaf's slot (its AccumulateGrad) has no number: Python reads its variable.
      out[s] = Crossing::make(
          crossing_->found,
          py::make_tuple(python_object(held_[s]), key.nr, std::move(python_producers), op.name,
                         op.leaf ? py::object(py::none()) : py::object(py::int_(key.node->sequence_nr())),
                         metadata_bytes(*key.node, key.nr), functions));
    }
    python_slots_ = std::move(out);
  }

  // The tensor of a leaf's slot (its AccumulateGrad's variable), or nullptr.
  static const at::Tensor* leaf_of(Node* node) {
    const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(node);
    return accumulate != nullptr && accumulate->variable.defined() ? &accumulate->variable : nullptr;
  }

  // (lowest number, the flat tuple) as graph.py's _shape makes them, or
  // (None, None) where no node has a number.
  void make_shape(const std::vector<ShapeEntry>& entries) {
    bool any = false;
    int64_t low = 0;
    size_t size = 0;
    for (const auto& e : entries) {
      size += e.count >= 0 ? 4 : 2;
      if (e.has_seq && (!any || e.seq < low)) {
        low = e.seq;
        any = true;
      }
    }
    if (!any) {
      shape_ = py::make_tuple(py::none(), py::none());
      return;
    }
    // A training loop's steps make equal shapes: the last one's tuple is
    // handed out again, so that advise()'s lookup of a graph it described
    // compares it by identity (tuple equality tries identity first).
    struct LastShape {
      std::vector<ShapeEntry> entries;  // seq relative to the lowest
      py::object flat;
    };
    static auto* const last = new LastShape();  // never freed: outlives Python
    const bool same = last->flat && last->entries.size() == entries.size() &&
                      std::equal(entries.begin(), entries.end(), last->entries.begin(),
                                 [&](const ShapeEntry& e, const ShapeEntry& l) {
                                   return e.op.ptr() == l.op.ptr() && e.has_seq == l.has_seq &&
                                          (!e.has_seq || e.seq - low == l.seq) && e.nr == l.nr &&
                                          e.count == l.count;
                                 });
    if (same) {
      shape_ = py::make_tuple(py::int_(low), last->flat);
      return;
    }
    py::tuple flat(size);
    size_t i = 0;
    auto number = [&](const ShapeEntry& e) {
      return e.has_seq ? py::object(py::int_(e.seq - low)) : py::object(py::none());
    };
    for (const auto& e : entries) {
      flat[i++] = e.op;
      if (e.count >= 0) {
        flat[i++] = py::int_(e.nr);
        flat[i++] = number(e);
        flat[i++] = py::int_(e.count);
      } else {
        flat[i++] = number(e);
      }
    }
    last->entries = entries;
    for (auto& e : last->entries) {
      e.seq = e.has_seq ? e.seq - low : 0;
    }
    last->flat = flat;
    shape_ = py::make_tuple(py::int_(low), std::move(flat));
  }

  // The root gradients (grad_tensors: a Tensor, or anything else for none)
  // are in their slots before any node runs: they arrive now, in the order
  // of the slots and their producers.
  void arrive_roots(const std::vector<std::pair<SlotKey, std::vector<Producer>>>& slots,
                    py::handle grad_tensors) {
    const bool given = !grad_tensors.is_none() && PySequence_Check(grad_tensors.ptr());
    const Py_ssize_t count = given ? PySequence_Size(grad_tensors.ptr()) : 0;
    if (count < 0) {
      throw py::error_already_set();
    }
    for (size_t s = 0; s < slots.size(); ++s) {
      const auto& producers = slots[s].second;
      for (size_t p = 0; p < producers.size(); ++p) {
        if (producers[p].node != nullptr) {
          continue;
        }
        const auto position = static_cast<Py_ssize_t>(producers[p].position);
        py::object root;
        if (position < count) {
          root = py::reinterpret_steal<py::object>(PySequence_GetItem(grad_tensors.ptr(), position));
          if (!root) {
            throw py::error_already_set();
          }
        }
        const at::Tensor* tensor = root && THPVariable_Check(root.ptr()) ? &THPVariable_Unpack(root.ptr()) : nullptr;
        record_->arrive(s, static_cast<int32_t>(p), tensor, kNothing, false);
      }
    }
  }

  struct EdgeRecord {
    SlotKey key;
    Producer producer;
  };

  std::shared_ptr<Record> record_;
  std::shared_ptr<const Crossing> crossing_;
  std::vector<EdgeRecord> edges_;  // every edge the walk found, in order
  ska::flat_hash_map<SlotKey, uint32_t, SlotKeyHash> counts_;  // producers per slot
  // Every node the walk reached, and its reference (nullptr for a root given as a node object);
  // after construction only its keys are read (contains), and only where kept.
  ska::flat_hash_map<Node*, const NodeRef*> refs_;
  std::vector<GivenEdge> roots_;  // while constructing
  std::unordered_map<Node*, py::handle> root_objects_;  // while constructing: the roots given as node objects
  // The slots and their producers, and what the Python view names, held.
  std::vector<std::pair<SlotKey, std::vector<Producer>>> slots_;
  std::vector<Held> held_;  // each slot's consumer
  ska::flat_hash_map<Node*, Held> held_functions_;  // each custom Function producer
  size_t functions_ = 0;
  size_t python_nodes_ = 0;
  py::list python_slots_{py::reinterpret_steal<py::list>(py::handle())};  // made at the first slots()
  py::object shape_ = py::none();  // make_shape's, or None: Python shapes the slots
};

// advise()'s view of a model (torch_ctxext/_advise/modules.py, ModelView):
// per module its class, what it calls instead of its class's _call_impl
// (Module.compile()'s compiled function, its own _call_impl, or none), and
// the keys and values of its _modules and _parameters in order, by
// address, as one bytes object: equal while the
// model's structure is what the view read. Asked as every advise() block
// enters (a training loop's every step); Python's tuples of the same took
// 0.7 us a module. A key re-made equal but not identical reads as a
// change (the view is then read again: never a stale name).
py::bytes module_structure(const py::sequence& modules) {
  static PyObject* const names[2] = {PyUnicode_InternFromString("_modules"),
                                     PyUnicode_InternFromString("_parameters")};  // never freed
  static PyObject* const bypasses[2] = {PyUnicode_InternFromString("_compiled_call_impl"),
                                        PyUnicode_InternFromString("_call_impl")};  // never freed
  std::string out;
  auto put = [&out](const void* value) {
    const auto bits = reinterpret_cast<uintptr_t>(value);
    out.append(reinterpret_cast<const char*>(&bits), sizeof(bits));
  };
  for (const auto& item : modules) {
    PyObject* module = item.ptr();
    put(Py_TYPE(module));
    PyObject* own = PyObject_GenericGetDict(module, nullptr);
    if (own == nullptr) {
      throw py::error_already_set();
    }
    const auto own_ref = py::reinterpret_steal<py::object>(own);
    auto own_item = [own](PyObject* name) {  // borrowed, or nullptr where absent
      PyObject* found = PyDict_GetItemWithError(own, name);
      if (found == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      return found;
    };
    for (PyObject* name : bypasses) {
      PyObject* function = own_item(name);
      put(function == Py_None ? nullptr : function);
    }
    for (PyObject* name : names) {
      PyObject* held = own_item(name);
      if (held == nullptr || !PyDict_Check(held)) {
        put(held);  // none, or not a dict: by identity
        continue;
      }
      put(reinterpret_cast<const void*>(static_cast<uintptr_t>(PyDict_GET_SIZE(held))));
      Py_ssize_t position = 0;
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      while (PyDict_Next(held, &position, &key, &value)) {
        put(key);
        put(value);
      }
    }
  }
  return py::bytes(out);
}

// advise()'s signature of a forward's module calls (Advise._signature): each
// call as filed, a (start, end, module) tuple, as its numbers less `low` (a
// number the backward's nodes have: equal for two steps of one loop) or a
// mark for None, the module's address and its class's, in one bytes
// object. The modules are the model's (its view holds them while it is
// current), so an address names one module. Python's loop over the same
// was a tenth of a small step's watch.
py::bytes calls_signature(const py::list& calls, int64_t low) {
  std::string out;
  out.reserve(static_cast<size_t>(PyList_GET_SIZE(calls.ptr())) * 4 * sizeof(int64_t));
  auto put = [&out](int64_t value) { out.append(reinterpret_cast<const char*>(&value), sizeof(value)); };
  for (const auto& item : calls) {
    PyObject* call = item.ptr();
    if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 3) {
      throw py::type_error("calls_signature: each call is a (start, end, module) tuple");
    }
    for (Py_ssize_t i = 0; i < 2; ++i) {
      PyObject* number = PyTuple_GET_ITEM(call, i);
      if (number == Py_None) {
        put(std::numeric_limits<int64_t>::min());
        continue;
      }
      const long long value = PyLong_AsLongLong(number);
      if (value == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
      }
      put(static_cast<int64_t>(value) - low);
    }
    PyObject* module = PyTuple_GET_ITEM(call, 2);
    put(static_cast<int64_t>(reinterpret_cast<intptr_t>(module)));
    put(static_cast<int64_t>(reinterpret_cast<intptr_t>(Py_TYPE(module))));
  }
  return py::bytes(out);
}

}  // namespace

void bind_advise_watch(py::module_& m) {
  py::class_<Watch>(m, "AdviseWatch",
                    "One backward watched for advise() (torch_ctxext/_advise/graph.py)")
      .def_property_readonly("slots", &Watch::slots)
      .def_property_readonly("functions", &Watch::functions)
      .def_property_readonly("python_nodes", &Watch::python_nodes)
      .def("leaves", &Watch::leaves)
      .def("outcome", &Watch::outcome)
      .def_property_readonly("shape", &Watch::shape)
      .def("arrive", &Watch::arrive, py::arg("slot"), py::arg("producer"), py::arg("gradient"),
           py::arg("fused") = false, py::arg("stock_view") = false)
      .def("finish", &Watch::finish)
      .def("walked", &Watch::walked)
      .def("close", &Watch::close)
      .def("contains", &Watch::contains, py::arg("node"))
      .def("given", &Watch::given, py::arg("slot"))
      .def("results", &Watch::results)
      .def_property_readonly("compiled", &Watch::compiled)
      .def_property_readonly("error", &Watch::error);
  m.def("calls_signature", &calls_signature, py::arg("calls"), py::arg("low"),
        "A forward's module calls ((start, end, module) each), numbers less low, with each "
        "module's and its class's address, as bytes (advise()'s signature of a step)");
  m.def("module_structure", &module_structure, py::arg("modules"),
        "Each module's class and the keys and values of its _modules and _parameters, by "
        "address, as bytes (advise()'s view of a model: torch_ctxext/_advise/modules.py)");
  m.def(
      "advise_watch",
      [](const py::sequence& roots, const py::sequence& inputs, py::handle crossing, bool keep_nodes,
         py::handle grad_tensors) {
        return std::make_unique<Watch>(roots, inputs, crossing, keep_nodes, grad_tensors);
      },
      py::arg("roots"), py::arg("inputs"), py::arg("crossing"), py::arg("keep_nodes") = false,
      py::arg("grad_tensors") = py::none(),
      "Walk a backward's graph from its roots ([a Tensor, (node, nr) or None]; inputs: "
      "the inputs= edges, or empty) and watch the slots two or more producers "
      "feed: an AdviseWatch. crossing: the types its fields cross as and "
      "the kinds of an arrival, by name (torch_ctxext._advise.graph.CROSSING). "
      "keep_nodes: remember every node reached, for AdviseWatch.contains "
      "(asked where the running torch provides input_grad_buffers itself, "
      "whose reasons for None it cannot tell). grad_tensors: the backward's "
      "root gradients, which arrive in their slots at once.");
}

}  // namespace torch_ctxext
