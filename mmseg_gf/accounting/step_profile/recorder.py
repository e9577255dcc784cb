"""The recorder that fills a :class:`~.step_cost_profile.StepCostProfile`
from the module calls and saved tensors of one traced step."""
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...models.patch_mean_graph import (LayerCall, filtered_users,
                                        graph_consumers, is_filtered_layer,
                                        is_plain_gelu)
from ...ops.conv.cost import map_output_stride
from ..kept import kept_by_call, measured_item
from ..kept_tokens import candidate_extra_items
from ..peak import Lifetime
from ..saved_bytes import UnmodelledBytes
from ..trace import ModuleCall, SavedPack, StepTracer
from .autograd_walks import loss_nodes, max_upstream, nodes_reading
from .candidate import ConvProfile, layer_geometry
from .gelu_call import GeluCall
from .kept_entry import KeptEntry
from .step_cost_profile import StepCostProfile

#: the attribute the probe's candidate outputs carry for the patch-mean
#: rule: ``(index, version, partition)``
PRODUCER_ATTR = '_gf_profile_producer'


class ProfileRecorder:
    """Fills a :class:`StepCostProfile` from the calls of the batch-1 trace.

    Candidate convs run with the exact backward, their outputs' autograd
    nodes tagged with their index; any other call's input is walked back to
    the last tagged node (:func:`~.autograd_walks.max_upstream`). With
    ``patch_means``, the GELU calls and the filtered candidates' calls
    around them are noted for the patch-mean rule (:class:`GeluCall`).
    """

    def __init__(self, probe: nn.Module, candidates: Sequence[nn.Module],
                 profile: StepCostProfile, is_classifier,
                 patch_means: bool = False) -> None:
        self.probe = probe
        self.patch_means = patch_means
        #: node -> the GELU call whose output it is
        self.gelu_nodes: Dict[Any, GeluCall] = {}
        #: node -> the filtered candidate call reading a GELU's output
        self.layer_calls: Dict[Any, LayerCall] = {}
        self.index = {m: i for i, m in enumerate(candidates)}
        self.profile = profile
        self.is_classifier = is_classifier
        self.tags: Dict[Any, int] = {}
        self.memo: Dict[Any, int] = {}
        self.shared: Dict[int, Tuple[str, Any]] = {}
        self.alive: Dict[int, Lifetime] = {}
        self.tracer: Optional[StepTracer] = None
        self.unmodelled = UnmodelledBytes.of(probe)
        self.pack_upstream: Dict[int, Tuple[int, bool]] = {}
        self.pack_freed: Dict[int, int] = {}
        self.by_storage: Dict[int, List[Lifetime]] = {}
        #: path -> the last candidate behind what a module's own code saved
        #: in its current call
        self.own_code_upstream: Dict[str, int] = {}

    def upstream(self, tensor: torch.Tensor) -> int:
        return max_upstream(tensor, self.tags, self.memo)

    def track(self, output: torch.Tensor, seq: int, upstream: int) -> None:
        """Note when a tensor that needs a gradient is made and freed."""
        if not output.requires_grad or id(output) in self.alive:
            return  # an in-place result is the tensor already tracked
        life = Lifetime(seq, upstream, output.nbytes)
        self.profile.tensors.append(life)
        self.alive[id(output)] = life
        ptr = output.untyped_storage().data_ptr()
        self.by_storage.setdefault(ptr, []).append(life)
        tracer, alive, by_storage = self.tracer, self.alive, self.by_storage

        def freed(key=id(output), life=life, ptr=ptr):
            life.freed = tracer.seq
            alive.pop(key, None)
            lives = by_storage.get(ptr, [])
            if life in lives:
                lives.remove(life)

        weakref.finalize(output, freed)

    def use(self, tensors, seq: Optional[int] = None) -> None:
        """Tensors read by an operation (or a module call) running during
        call ``seq`` (default: the call running now): the last use of the
        tracked tensors they are (or are views of)."""
        if seq is None:
            seq = self.tracer.seq
        for t in tensors:
            for life in self.by_storage.get(
                    t.untyped_storage().data_ptr(), ()):
                if life.last_use is None or life.last_use < seq:
                    life.last_use = seq

    def __call__(self, call: ModuleCall) -> None:
        if not isinstance(call.output, torch.Tensor):
            return
        if call.module in self.index:
            self.on_candidate(call)
        elif call.recorded:
            self.on_module(call)

    def on_candidate(self, call: ModuleCall) -> None:
        out = call.output
        if out.grad_fn is None:
            return
        i = self.index[call.module]
        self.unmodelled.note_call(call.seq, call.path, (), True)
        # inputs made by functional code (torch.cat, additions) are seen
        # here first
        upstream = self.upstream(call.x)
        self.track(call.x, call.seq, upstream)
        self.use([call.x], call.seq)
        self.tags[out.grad_fn] = i
        self.track(out, call.seq, i)
        if self.patch_means and is_filtered_layer(call.module):
            self.note_filtered_call(call, i)
        # what a trained attention's own code keeps besides its
        # projections (the profile skips the candidates' saved tensors)
        try:
            extra = candidate_extra_items(call.path, call.module,
                                          self.shared)
        except LookupError:
            raise ValueError(
                f'gradient_filter budget: what {call.path!r} keeps is not '
                'modelled (an attention whose probabilities dropout acts '
                'on in training); set its attention dropout to 0, or '
                "layer_kinds=['conv2d']") from None
        self.profile.entries.extend(
            KeptEntry(item, max(upstream, i), False, call.path, call.seq)
            for item in extra)
        if all(c.index != i for c in self.profile.convs):
            geometry = layer_geometry(call.module, call.x, out)
            self.profile.convs.append(ConvProfile(
                path=call.path, module=call.module, geometry=geometry,
                index=i, upstream=upstream,
                output_stride=map_output_stride(self.profile.input_size,
                                                geometry.map_area),
                params=sum(p.numel() for p in call.module.parameters()),
                seq=call.seq, input_shape=tuple(call.x.shape[1:])))

    def on_module(self, call: ModuleCall) -> None:
        x, out = call.x, call.output
        upstream = self.upstream(x)
        self.track(x, call.seq, upstream)
        self.use([x], call.seq)
        self.track(out, call.seq, max(upstream, self.upstream(out)))
        items, modelled = kept_by_call(self.probe, call.path, call.module, x,
                                       out, self.shared)
        self.unmodelled.note_call(call.seq, call.path, items, modelled)
        upstream, trained = self._owner_upstream(call, upstream)
        entries = [KeptEntry(item, upstream, trained, call.path, call.seq)
                   for item in items if not item.estimate]
        self.profile.entries.extend(entries)
        if self.patch_means and is_plain_gelu(call.module) and \
                out.grad_fn is not None:
            self.note_gelu(call, entries)
        if self.is_classifier(call.path) and call.trained:
            self.profile.classifiers.append(
                (layer_geometry(call.module, x, out),
                 upstream, call.seq))
            self.profile.classifier_params += sum(
                p.numel() for p in call.module.parameters())

    def note_filtered_call(self, call: ModuleCall, index: int) -> None:
        """A filtered candidate's call: mark its output with the patches
        its filtered call would tag it with (a GELU reading it keeps patch
        means of its derivative there), and, when it reads a GELU's
        output, note its nodes reading it as that GELU's consumer."""
        x, out = call.x, call.output
        part = call.module.output_partition(x, out)
        if part is None:  # its filtered call runs the exact backward
            return
        setattr(out, PRODUCER_ATTR, (index, out._version, part))
        node = x.grad_fn
        if node is None or node not in self.gelu_nodes:
            return
        consumer = LayerCall(node, call.module.input_partition(x), index)
        for reader in nodes_reading(out.grad_fn, node):
            self.layer_calls[reader] = consumer

    def note_gelu(self, call: ModuleCall, entries: List[KeptEntry]) -> None:
        """A plain GELU's call: what its rule kept and the candidate whose
        output (unchanged) it read."""
        x = call.x
        record = GeluCall(call.path, entries, tuple(x.shape),
                          x.element_size(), call.seq,
                          node=call.output.grad_fn)
        tag = getattr(x, PRODUCER_ATTR, None)
        if tag is not None and tag[1] == x._version:
            record.producer, record.partition = tag[0], tag[2]
        self.profile.gelu_calls.append(record)
        self.gelu_nodes[record.node] = record

    def resolve_gelus(self, losses: Any) -> None:
        """After the step: each GELU call's consumers, from the graph of
        ``losses`` (:func:`~mmseg_gf.models.patch_mean_graph.filtered_users`),
        and the graph's nodes let go."""
        if self.gelu_nodes:
            graph = graph_consumers(loss_nodes(losses))
            for record in self.profile.gelu_calls:
                record.users = filtered_users(record.node, graph,
                                              self.layer_calls)
        for record in self.profile.gelu_calls:
            record.node = None
        self.gelu_nodes.clear()
        self.layer_calls.clear()

    def _owner_upstream(self, call: ModuleCall,
                        upstream: int) -> Tuple[int, bool]:
        """``(upstream, trained)`` of a call: for a module with children
        reported as a call (a lean attention), what its own code saved
        depends on the candidates behind the operation's inputs (Swin's
        ``qkv`` before its SDPA, not the ``proj`` after it:
        :meth:`on_pack` notes them), and it is trained by the parameters
        of its own and of its children that are no candidates."""
        if not any(True for _ in call.module.children()):
            return upstream, call.trained
        own = self.own_code_upstream.pop(call.path, None)
        trained = any(p.requires_grad for m in call.module.modules()
                      if m not in self.index
                      for p in m.parameters(recurse=False))
        return (upstream if own is None else own), trained

    def on_pack(self, pack: SavedPack) -> None:
        """A saved tensor: held (unless a candidate saved it) with the last
        candidate behind the inputs of the operation saving it: the
        operation records once that candidate is trained (or always, when
        an input is a trained Parameter). An operation with several
        activation inputs saves one of them for the others' gradients
        (``x * gate`` keeps ``gate`` for ``x``'s gradient and ``x`` for
        ``gate``'s): such a tensor is counted by the last candidate behind
        the other activation inputs. A tensor saved by an operation without
        another activation input (GELU's or a norm's input) is counted by
        its own."""
        if pack.module in self.index:
            return
        inputs = list(pack.inputs) or [pack.tensor]
        others = [t for t in inputs if not isinstance(t, nn.Parameter)
                  and t.untyped_storage().data_ptr() != pack.ptr]
        upstream = max(self.upstream(t) for t in (others or inputs))
        trained = any(t.requires_grad and t.grad_fn is None for t in inputs)
        if not pack.leaf and pack.module is not None:
            # a module's own code (a lean attention's SDPA call)
            self.own_code_upstream[pack.owner] = max(
                upstream, self.own_code_upstream.get(pack.owner, -1))
        kept = self.unmodelled.on_pack(pack)
        self.pack_upstream[id(kept)] = (upstream, trained)
        # when the trace frees the saved tensor (it keeps nothing itself):
        # until then the forward's live bytes hold it
        tracer, freed = self.tracer, self.pack_freed

        def on_free(key=id(kept)):
            freed[key] = tracer.seq

        # (a view made for the save dies at once: follow its base)
        base = pack.tensor._base
        weakref.finalize(pack.tensor if base is None else base, on_free)

    def measured_entries(self) -> List[KeptEntry]:
        """One entry per storage no rule covers, counted once any of the
        operations that saved it is recorded."""
        entries = []
        for packs in self.unmodelled.by_storage():
            marks = [self.pack_upstream[id(p)] for p in packs]
            first = packs[0]
            resident = self.unmodelled.is_resident(first)
            freed = [self.pack_freed.get(id(p), -1) for p in packs]
            entries.append(KeptEntry(
                measured_item(first.owner, first.kind, first.nbytes,
                              self.unmodelled.is_constant(first)),
                max(u for u, _ in marks), any(t for _, t in marks),
                first.owner, first.seq,
                live_from=None if resident else (
                    -1 if min(freed) < 0 else max(freed)),
                resident=resident))
        return entries
