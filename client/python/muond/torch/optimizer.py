"""``muond.torch.Muon``: the optimizer surface (torch.optim.Optimizer's
methods); memory, registration, placement and wire conversion live in the
modules beside it (muond.torch's docstring has the whole contract)."""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import uuid
import weakref

import torch

from muond import qkv_split as _qkv_split
from muond import state as _state
from muond import step_channel as _step_channel
from muond._dtensor import is_dtensor
from muond.client import STEP_WITHDRAWN, Client, MuondError
from muond.torch import collective as _collective
from muond.torch import discovery as _discovery
from muond.torch import groups as _groups
from muond.torch import initial_groups as _initial_groups
from muond.torch import layouts as _layouts
from muond.torch import options as _options
from muond.torch import process_guard as _process_guard
from muond.torch import qk_clip as _qk_clip
from muond.torch import registration as _registration
from muond.torch import rpc as _rpc
from muond.torch import wire as _wire
from muond.torch.checks_alongside import ChecksAlongside
from muond.torch.lazy_state import LazyState
from muond.torch.memory import SharedParams, release

_PHASES = ("momentum_us", "a2a_fwd_us", "ns_us", "a2a_bwd_us", "dp_share_us", "update_us",
           "total_us", "handler_us")
# The longest StepRequest.trainer_refusal sent (the daemons repeat its first
# 128 bytes; the whole error is what the refusing trainer raises), so an
# error the size of a model's name list never meets gRPC's message limit.
_MAX_REFUSAL_CHARS = 4096


def _trip_legs(clients: list, responses: list, rpc_us: float) -> dict:
    """request_leg_us and answer_leg_us of a step that went through the
    step channel (one daemon, on this host): from the trainer's writing its
    request to the daemon's having read and parsed it, and from the daemon's
    encoding its answer to the trainer's having parsed it, on the clock both
    read (StepTimings received_at_us, answered_at_us). Empty for a step over
    the Step RPC, an answer too close to the channel's size for the stamps,
    and legs outside [0, rpc_us] (a daemon reading another clock, such as
    one in another time namespace)."""
    trip = clients[0].last_trip if len(clients) == 1 else None
    t = responses[0].timings
    if trip is None or t.received_at_us <= 0 or t.answered_at_us <= 0:
        return {}
    posted, returned = trip
    legs = {"request_leg_us": t.received_at_us - posted * 1e6,
            "answer_leg_us": returned * 1e6 - t.answered_at_us}
    return legs if all(0 <= leg <= rpc_us for leg in legs.values()) else {}


def _step_channel_poll_s(ms) -> float:
    """step_channel_poll_ms in seconds: a real number of ms (int, float,
    numpy scalar, one-element tensor; no bool in any form, as the groups'
    numbers) within muond.step_channel.answer_poll_seconds's bounds, else
    ValueError."""
    try:
        return _step_channel.answer_poll_seconds(
            _groups._real("Muon", "step_channel_poll_ms", ms) / 1e3)
    except (ValueError, OverflowError):  # OverflowError: an int past float's range
        raise ValueError(f"step_channel_poll_ms must be a number of ms in [0, "
                         f"{_step_channel.MAX_ANSWER_POLL_S * 1e3:g}], got {ms!r}") from None


class AddParamGroupError(RuntimeError):
    """add_param_group failed and registering the old groups again failed
    too: the optimizer is closed and unregistered from every daemon it
    reached. ``state_dict`` is the optimizer's state before the call, in
    torch.optim's format: resume with a new muond.torch.Muon (the old groups)
    and ``load_state_dict(error.state_dict)``."""

    def __init__(self, message: str, state_dict: dict):
        super().__init__(message)
        self.state_dict = state_dict


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's step on muond daemons (muond.torch's docstring has
    the whole contract). ``params`` as torch.optim takes them: param groups
    (dicts; a group with ``"algorithm": "adamw"`` steps with AdamW, every
    param of any other group a matrix or a batch of them: muond.batched), or
    a plain iterable of params or
    of ``(name, param)`` pairs (``model.parameters()``,
    ``model.named_parameters()``), whose 2-D params form a Muon group and
    every other param (biases, norm weights, scalars, conv kernels) an AdamW
    group with the same lr and weight_decay (initial_groups.split_plain_params).
    """

    def __new__(cls, *args, **kwargs):
        # torch.optim.Optimizer's first use in a process imports torch._dynamo,
        # whose import leaves a reference cycle through the frames running it
        # (torch.fx.wrap keeps its own frame), so through every caller's frame.
        # Imported before the optimizer exists and that garbage collected at
        # once, no frame keeps the optimizer or its caller's locals alive.
        if "torch._dynamo" not in sys.modules:
            import torch._dynamo  # noqa: F401
            gc.collect()
        return super().__new__(cls)

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_coefficients=None,
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 newton_schulz: _options.NewtonSchulzOptions | None = None,
                 scaling: _options.ScalingOptions | None = None,
                 adamw: _options.AdamWOptions | None = None,
                 state_storage: _options.StateStorageOptions | None = None,
                 placement: _options.PlacementOptions | None = None,
                 connection: _options.ConnectionOptions | None = None,
                 name: str | None = None, qk_clip: _qk_clip.QKClip | None = None, **flat):
        self._creator_pid = os.getpid()  # process_guard: only it steps and loads
        self._replays = _process_guard.ReplayCheck()
        o = _options.resolve(flat, dict(newton_schulz=newton_schulz, scaling=scaling,
                                        adamw=adamw, state_storage=state_storage,
                                        placement=placement,
                                        connection=connection))
        if not _groups.is_bool(o["step_channel"]):
            raise ValueError(f"step_channel must be a bool, got {o['step_channel']!r}")
        self._wants_step_channel = bool(o["step_channel"])
        if not _groups.is_bool(o["overlap_checks"]):
            raise ValueError(f"overlap_checks must be a bool, got {o['overlap_checks']!r}")
        self._alongside = ChecksAlongside(bool(o["overlap_checks"]))
        self._step_channel_poll_s = _step_channel_poll_s(o["step_channel_poll_ms"])
        defaults = _initial_groups.muon_defaults(lr, weight_decay, momentum, nesterov,
                                                 ns_coefficients, eps, ns_steps, adjust_lr_fn, o)
        params = _initial_groups.with_adamw_options(
            _initial_groups.split_plain_params(list(params)), defaults, o["betas"],
            o["adamw_eps"])
        super().__init__(params, defaults)
        for gi, grp in enumerate(self.param_groups):
            _groups.check_options(gi, grp)
        self._qkv = _qkv_split.Choice.of(o)  # which Muon params split QKV, and how
        self.state = LazyState(self)  # the daemons hold it; see LazyState
        daemons, job_id, no_daemon = self._find_daemons(o)
        self._layout.check_daemons(len(daemons))
        self.job_id, self.domain_name = job_id, o["domain_name"]
        self.gtp_size, self.tp_size = int(o["gtp_size"]), int(o["tp_size"])
        self.g, self.t = int(o["g"]), int(o["t"])
        self._dp = (o["dp_size"], o["dp_rank"])
        self.places: dict = {}  # local mode: param name -> muond.torch.placement.ParamPlace
        self.client_id = (o["client_id"]
                          or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.step_id = int(o["first_step_id"]) - 1
        self.last_timings: dict[str, float] = {}
        # param name -> SplitLayout | ("solo", rank) | "local"
        self.layouts: dict[str, object] = {}
        self._memory = SharedParams(job_id)
        self._param_names: dict[int, str] = {}  # id(param) -> its wire name
        self._ranks_of: dict[str, tuple[int, ...]] = {}  # param name -> daemons holding it
        self._matrices: dict[str, tuple] = {}  # batched param -> ((wire name, daemon), ...)
        self._fixed: dict[int, dict] = {}  # group index -> its entries fixed at registration
        self._params_seen = _groups.ParamsSeen()  # the params lists step() checked
        self._unchanged_groups = _groups.UnchangedGroups()  # what the last check passed
        self._group_params: list = []  # per registered group: the ids of its params
        # rank -> [(param group index, wire group name)] registered with that daemon
        self._wire_groups: dict[int, list[tuple[int, str]]] = {}
        self._closed = False
        # An AdamW group's defaults, also for one added later (torch.optim's
        # defaults, a Muon group's, have no betas unless every group is AdamW).
        self._adamw_defaults = {"betas": o["betas"], "eps": o["adamw_eps"]}
        self._wait_healthy_timeout = o["wait_healthy_timeout"]
        # The daemons' optimizer instance this optimizer registers as.
        self.name = _registration.instance_name(name)
        self.clients = [Client(a, timeout=o["rpc_timeout"], token=o["token"],
                               token_file=o["token_file"],
                               root_certificates=o["tls_root_certificates"],
                               optimizer=self.name) for a in daemons]
        # Runs at close(), when the optimizer is collected, and at interpreter
        # exit (also after an uncaught exception): unregisters from every
        # daemon, else a new trainer on them is refused ALREADY_REGISTERED.
        # It holds the clients and ids, never the optimizer.
        self._finalizer = weakref.finalize(self, _registration.finalize, self._memory,
                                           self.clients, job_id, self.client_id,
                                           self._creator_pid, self._local_lease)
        self._pending_registration = (no_daemon, o["takeover"], qk_clip)
        if self.registers_at_construction:
            self._ensure_registered()

    # False in a subclass that registers at its first step or state access
    # (muond.megatron: Megatron's mixed-precision wrapper replaces the
    # params of the optimizer it wraps by fp32 copies after construction).
    registers_at_construction = True

    def _ensure_registered(self) -> None:
        """Places and registers every param unless done already."""
        if self._pending_registration is None:
            return
        if self._closed:
            failed = getattr(self, "_registration_error", None)
            raise RuntimeError("muond.torch.Muon used after close()" + (
                f": its registration at first use failed ({failed}), which closed it; "
                "build a new optimizer" if failed is not None else ""))
        no_daemon, takeover, qk_clip = self._pending_registration
        try:
            self._register(no_daemon, takeover)
            self._qk_clip = _qk_clip.bind(qk_clip, self)  # muond.torch.qk_clip
        except BaseException as error:
            # Leave nothing registered (the finalizer unregisters this client
            # id everywhere): otherwise the daemons refuse every later trainer.
            self._closed, self._registration_error = True, error
            self._finalizer()
            raise
        self._pending_registration = None

    def _find_daemons(self, o: dict):
        """(daemon addresses, job id, why this rank's discovered daemon
        cannot be there or None); sets the rank, the world and the layout
        strategy. Without daemons= (torchrun/srun): this rank's own daemon
        (muond.torch.discovery) in local mode."""
        daemons = o["daemons"]
        daemons = [daemons] if isinstance(daemons, str) else list(daemons)
        job_id, shard_mode, token_file = o["job_id"], o["shard_mode"], o["token_file"]
        self._rank, self._world = _collective.process_rank()
        no_daemon, self._local_lease = None, None
        if not daemons:
            found = (_discovery.local_daemon(self.param_groups, job_id, o["wait_healthy_timeout"])
                     or _discovery.discover(job_id))
            self._local_lease = found.lease
            no_daemon = found.missing_socket()
            daemons, job_id = [found.address], found.job_id
            if o["token"] is None and token_file is None:
                o["token_file"] = found.token_file
            if found.rank is not None and self._world <= 1:
                self._rank = found.rank
            shard_mode = shard_mode or "local"
        job_id = job_id if job_id is not None else "default"
        self.shard_mode = shard_mode or "split"
        self._layout = _layouts.strategy(
            self.shard_mode, rank=self._rank, world=self._world, domain_name=o["domain_name"],
            gtp_size=o["gtp_size"], tp_size=o["tp_size"], g=int(o["g"]),
            t=int(o["t"]), dp_size=o["dp_size"], dp_rank=o["dp_rank"])
        return daemons, job_id, no_daemon

    # -- registration ------------------------------------------------------
    def _register(self, no_daemon: str | None, takeover: bool) -> None:
        """Waits for the daemons, places every param and registers it, all
        ranks of a collective placement agreeing on every refusal."""
        try:
            if no_daemon is not None:
                # No socket: waiting cannot help (a forgotten $MUOND_JOB_ID).
                # Given daemons= are waited for: a launcher may start them now.
                raise FileNotFoundError(no_daemon)
            for c in self.clients:
                c.wait_healthy(self._wait_healthy_timeout)
            # One trainer per daemon: the worlds agree (a local cluster is one
            # daemon for this process, whatever $WORLD_SIZE MUOND_LOCAL=1 overrode).
            if self.shard_mode == "local" and self._local_lease is None:
                _discovery.check_daemon_world(self.clients[0], self._rank, self._world)
            unhealthy = None
        except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
            unhealthy = e
        if unhealthy is not None and not self._layout.collective:
            raise unhealthy
        # In a distributed local-mode job a daemon that is not healthy on
        # one rank is that rank's refusal in the placement agreement: every
        # rank raises it instead of waiting in a collective.
        per_rank = self._place_params(unhealthy)
        try:
            _registration.register_taking_over_stale(self.clients, self.job_id, self.client_id,
                                                     per_rank, self._memory.regions, takeover)
            refused = None
        except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
            refused = e
        # A daemon that refuses this rank's registration never publishes
        # its manifest, so its peers would wait for a plan until their
        # timeout: in a distributed job every rank raises the refusal.
        if self._layout.collective:
            _collective.agree_registered(refused, self._rank)
        elif refused is not None:
            raise refused
        for c in self.clients:
            c.wait_healthy(self._wait_healthy_timeout, need_plan=True)
        # The daemons read the shared grad buffers, which never move.
        self._on_cuda = self._memory.any_cuda()
        self._open_step_channel(per_rank)
        self._registered = True

    def _open_step_channel(self, per_rank: list) -> None:
        """With step_channel on and one daemon (a torchrun rank's), steps go
        through shared memory (muond.step_channel), sized for the
        registration ``per_rank[0]``; where the daemon offers none, over
        gRPC. Several daemons' steps stay concurrent gRPC calls."""
        if not self._wants_step_channel or len(self.clients) != 1:
            return
        request, response = _step_channel.capacities(per_rank[0], _MAX_REFUSAL_CHARS * 4)
        # Polling only while a GPU runs the step: a host daemon's step
        # needs the cores a polling trainer would take.
        self.clients[0].open_step_channel(self.job_id, request, response,
                                          self._step_channel_poll_s if self._on_cuda else 0.0)

    def _place_params(self, refusal: BaseException | None = None) -> list:
        """Every param's wire groups per daemon, placed by the layout
        strategy of this optimizer's shard_mode (muond.torch.layouts)."""
        registered_live = getattr(self, "_registered_live", {})
        run = _layouts.PlacementRun(
            lambda: _groups.collect_params(self.param_groups, registered_live, self._qkv),
            self._memory, len(self.clients), self._qkv.split_of)
        try:
            return self._layout.place(run, refusal)
        finally:
            self._adopt(run)

    def _adopt(self, run) -> None:
        """Takes what a placement recorded (also of one that failed half
        way, as the optimizer's own tables were filled as it went)."""
        if run.collected is not None:
            self._placed_live = run.collected.live
            self._fixed.update(run.collected.fixed)
            self._param_names.update(run.collected.names)
            self._group_params = [frozenset(map(id, g["params"])) for g in self.param_groups]
        if run.places is not None:
            self.places = run.places
        self.layouts.update(run.layouts)
        self._ranks_of.update(run.ranks_of)
        self._matrices.update(run.matrices)
        for rank, pairs in run.wire_groups.items():
            self._wire_groups.setdefault(rank, []).extend(pairs)

    # -- the shared memory (tests and tools read these) --------------------
    @property
    def _buffers(self):
        return self._memory.buffers

    @property
    def _regions(self):
        return self._memory.regions

    @property
    def _grads(self):
        return self._memory.grads

    @property
    def _views(self):
        return self._memory.views

    @property
    def _dtensors(self):
        return self._memory.dtensors

    # -- optimizer API -----------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim: ``set_to_none=True`` (the default) sets every
        ``.grad`` to None (step() skips a param whose grad stays None, and
        copies a new grad into the shared buffer); ``set_to_none=False``
        zeroes the shared grad in place and points ``.grad`` at it (the next
        backward accumulates where the daemons read: no copy at step()).
        Unlike torch, set_to_none=False also gives a param whose ``.grad``
        was None the zeroed shared grad (when it requires grad): that is how
        the zero-copy loop starts on a fresh model; such a param is then
        stepped with a zero grad unless a backward reaches it. A grad torch
        will not bind (a param rebound since registration to another dtype,
        shape or device) is a ValueError naming the param and what changed,
        as step() raises, and refuses the coming step on every rank."""
        self._ensure_registered()
        try:
            self._memory.zero_grad(set_to_none)
            return
        except RuntimeError:
            # torch refuses a grad of another dtype, shape or device: a param
            # rebound since registration. Followed or refused only then
            # (step() checks anyway), not on every zero_grad.
            pass
        with self._refused_on_every_rank():
            self._memory.follow_rebound_params(self._param_names)
            self._memory.zero_grad(set_to_none)

    def _overrides(self, rank: int) -> list:
        """The live hyperparameters (LIVE_KEYS) of every group this daemon
        holds, read from param_groups now (LR schedulers, momentum warm-up);
        a daemon never sees a group it does not hold."""
        return [_wire.override(wname, self.param_groups[gi])
                for gi, wname in self._wire_groups.get(rank, [])]

    @torch.no_grad()
    def step(self, closure=None, qk_max_logits=None):
        self._ensure_registered()
        if self._closed:
            raise RuntimeError("muond.torch.Muon.step after close()")
        _process_guard.check_creator_process(self._creator_pid, "step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._alongside.step(self, qk_max_logits):
            return loss
        # Everything before the Step is sent: a failure here (a check, an
        # assigned state that does not fit, a grad that cannot be copied) is
        # this step's refusal on every rank, or the peers wait for this one.
        with self._refused_on_every_rank():
            # Whether the grads are in place (the usual step: backward
            # accumulated into the shared grads) is found once, here.
            in_place = self._check_registered_groups()
            clip = _qk_clip.prepare(self._qk_clip, qk_max_logits, self)
            self._memory.follow_rebound_params(self._param_names)
            self._memory.check_permuted(self._param_names)
            self.state.push_if_assigned()
            self.state.invalidate()  # the step changes the state: read it afresh
            skipped = _wire.matrices_of(self._memory.skipped_and_copy_grads(
                self._param_names, self._ranks_of, len(self.clients), in_place),
                self._matrices)
            if self._on_cuda:
                torch.cuda.synchronize()  # the daemon reads grads from another process
            overrides = [self._overrides(r) for r in range(len(self.clients))]
            self._alongside.checked_first(skipped, in_place)
        # The id advances only when every daemon applied the step: a refused
        # step (e.g. non-finite gradients, refused on every rank before
        # anything changed) can be retried with the same id, and so can one
        # that failed with PEER_GONE (a peer's step failed or never came:
        # nothing applied; the daemons rebuild their communicators, and the
        # next step() waits for that). No retry here: the peer's trainer may
        # not have sent its step at all, and only the caller knows.
        step_id = self.step_id + 1
        t0 = time.perf_counter()
        try:
            # Another rank's trainer may withdraw the step it sent before its
            # checks (overlap_checks): nothing was applied, and that rank sends
            # it again after its checks; so does this one, once.
            for resent in (False, True):
                try:
                    responses = self._send_step(step_id, overrides, skipped)
                    break
                except MuondError as e:
                    if e.reason != STEP_WITHDRAWN:
                        raise
                    if resent:
                        raise MuondError(
                            f"step {step_id} was withdrawn again after this trainer sent it "
                            f"a second time ({e}); a peer trainer keeps withdrawing it: that "
                            "trainer's own error says why", e.code, e.reason,
                            e.metadata) from e
        except BaseException:
            self._replays.sent_without_answer(step_id)
            raise
        self._finish_step(step_id, responses, t0, clip)
        return loss

    def _finish_step(self, step_id: int, responses: list, t0: float, clip: list) -> None:
        """After every daemon applied step ``step_id`` (sent at ``t0``)."""
        self._replays.check(step_id, responses, self.client_id)
        self._memory.copy_dtensors_out()
        _qk_clip.apply(clip, responses)  # only once every daemon applied the step
        self.step_id = step_id
        rpc_us = (time.perf_counter() - t0) * 1e6
        timings = {k: max(getattr(r.timings, k) for r in responses) for k in _PHASES}
        timings["rpc_us"] = rpc_us
        timings["overhead_us"] = rpc_us - timings["total_us"]
        timings.update(_trip_legs(self.clients, responses, rpc_us))
        self.last_timings = timings
        self.last_responses = responses

    def _check_registered_groups(self) -> bool:
        """The groups are still the ones registered (groups.check_before_step:
        fixed entries unchanged, live ones typed, the same param tensors,
        dense grads), else the error naming group and key, before any RPC.
        step() and every re-registration check it: registering again would
        otherwise apply a changed fixed entry silently, and a failed one
        register the changed groups as the old ones. Returns
        SharedParams.grads_in_place() as it found it (step() copies no grad
        then)."""
        in_place = self._memory.grads_in_place()
        # The usual step: the groups hold exactly what the last check passed.
        checked = (self.param_groups, self._fixed, self._param_names,
                   self._memory.rebound_ids, in_place, self._group_params)
        if self._unchanged_groups.holds(*checked):
            return in_place
        _groups.check_before_step(self.param_groups, self._fixed, self._param_names,
                                  self._params_seen, self._memory.rebound_ids, in_place,
                                  self._group_params)
        self._unchanged_groups.take(*checked)
        return in_place

    @contextlib.contextmanager
    def _refused_on_every_rank(self):
        """A failure of the coming step here (a check's TypeError, ValueError
        or RuntimeError, or any other Exception: before any Step is sent, so
        the peers would wait for this rank) is sent to this trainer's daemons
        as the step's refusal (StepRequest.trainer_refusal) before it is
        raised, unchanged: the job votes on it, so the peers' step() fails at
        once, naming this rank, instead of waiting for the communicator
        timeout. Nothing changes on any rank; the same step can be sent
        again. KeyboardInterrupt and SystemExit are raised as they come."""
        try:
            yield
        except Exception as refused:
            self._send_refusal(refused)
            raise

    def _send_refusal(self, refused: Exception) -> None:
        """Step step_id + 1 refused on every daemon of this trainer, saying
        `refused` (at most _MAX_REFUSAL_CHARS, valid UTF-8); their answers (the
        refusal, or an error of their own) are not this step's error: the
        caller raises its own, which nothing here replaces."""
        try:
            why = f"{type(refused).__name__}: {refused}"
        except Exception:  # noqa: BLE001 (an error whose str() fails)
            why = type(refused).__name__
        if len(why) > _MAX_REFUSAL_CHARS:
            why = why[:_MAX_REFUSAL_CHARS] + f"...({len(why)} characters)"
        why = why.encode("utf-8", "backslashreplace").decode("utf-8")
        step_id = self.step_id + 1
        futures = []
        for c in self.clients:
            try:
                futures.append(c.step_future(self.job_id, step_id, (), self.client_id, (),
                                             trainer_refusal=why))
            except Exception:  # noqa: BLE001 (a channel that cannot send: its daemon waits)
                pass
        for future in futures:
            try:
                future.result()
            except Exception:  # noqa: BLE001 (the expected refusal, or a daemon gone)
                pass

    def _send_step(self, step_id: int, overrides: list, skipped: list) -> list:
        """Step `step_id` on every daemon; their responses, in rank order."""
        what = f"Step {step_id}"
        if len(self.clients) == 1:  # a blocking call: no future, no extra thread
            first = self.clients[0]
            return [_rpc.result(lambda: first.step(self.job_id, step_id, overrides[0],
                                                   self.client_id, skipped[0]),
                                first, what)]
        futures = [c.step_future(self.job_id, step_id, overrides[r], self.client_id, skipped[r])
                   for r, c in enumerate(self.clients)]
        return _rpc.gather(futures, self.clients, what)

    @property
    def uses_step_channel(self) -> bool:
        """Whether the next step goes to the daemon through a step channel
        (shared memory and a futex) rather than the Step RPC: step_channel
        on, one daemon, and it opened one (client README "The step
        channel"); False before registration (the first step registers)."""
        return len(self.clients) == 1 and self.clients[0].has_step_channel

    def status(self):
        self._ensure_registered()
        return [c.status() for c in self.clients]

    # -- optimizer state (muond.state converts; the daemons hold it) -------
    def _param_infos(self) -> list[_state.ParamInfo]:
        """Every param in torch.optim's index order, with where its state lives."""
        infos = []
        for group in self.param_groups:
            for p in group["params"]:
                name = self._param_names[id(p)]
                infos.append(_state.param_info(name, group, p, self.layouts[name]))
        return infos

    def _fetch_state(self) -> dict:
        """param -> torch.optim's state of it, assembled from every daemon's
        ExportState (tensors on the param's device; a DTensor param's state
        DTensors of its placements, muond.state.as_dtensor)."""
        if self._closed:
            raise RuntimeError("muond.torch.Muon: the state lives in the daemons, and this "
                               "optimizer is closed")
        self._ensure_registered()
        exported = self._on_all(lambda c: c.export_state(self.job_id, self.client_id),
                                "ExportState")
        infos = self._param_infos()
        by_name = _state.assemble(infos, {r: e for r, (_, e) in enumerate(exported)})
        info_of = {info.name: info for info in infos}
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                name = self._param_names[id(p)]
                out[p] = {k: v if k == "step" else
                          _state.as_dtensor(info_of[name], v.to(p.device), k)
                          for k, v in by_name[name].items()}
        return out

    def _push_state(self, states_by_name: dict, step_id: int) -> None:
        """Imports ``states_by_name`` (muond.state.validate's result) into every
        daemon, all or nothing: each daemon checks and stages its entries under
        one transaction id, then all commit; if any refuses, all abort."""
        per_rank = _state.disassemble(self._param_infos(), states_by_name, len(self.clients))
        txn = f"{self.client_id}-{uuid.uuid4().hex[:12]}"
        try:
            self._on_all(lambda c, r: c.import_state(self.job_id, self.client_id, step_id,
                                                     per_rank[r], transaction_id=txn),
                         "ImportState", with_rank=True)
        except BaseException:
            for c in self.clients:
                try:
                    c.abort_state(self.job_id, self.client_id, txn)
                except Exception:  # not staged there, or unreachable: nothing to drop
                    pass
            raise
        # Every daemon validated and staged its part: COMMIT no longer fails
        # on the content, only if a daemon is gone.
        self._on_all(lambda c: c.commit_state(self.job_id, self.client_id, txn),
                     "LoadState COMMIT")
        self.state.invalidate()

    def _on_all(self, call, what: str, with_rank: bool = False) -> list:
        """call(client) on every daemon concurrently (muond.torch.rpc.on_all)."""
        return _rpc.on_all(self.clients, call, what, with_rank)

    def state_dict(self):
        """torch.optim's format: "state" keyed by param index, each param's
        state fetched from the daemons (Muon: {"momentum_buffer"}, AdamW:
        {"step", "exp_avg", "exp_avg_sq"}; full param shapes), "param_groups"
        with every group's options and the job's step id as "muond_step_id"
        (kept by torch.distributed.checkpoint, unlike a top-level key)."""
        self._ensure_registered()
        return self._pack_state_dict(self.state.items())

    def _pack_state_dict(self, states) -> dict:
        """torch.optim's state dict of ``states`` ((param, its state) pairs or
        a dict of them) and this optimizer's groups and step id."""
        states = dict(states)
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            packed[_state.STEP_ID_KEY] = self.step_id
            groups.append(packed)
        # Copies: opt.state's cache must keep what the daemons hold even if
        # the caller edits the returned tensors in place.
        state = {index[id(p)]: {k: v.clone() for k, v in s.items()}
                 for p, s in states.items()}
        # Also at the top level, where torch.save keeps it and older muond
        # state dicts had it (load_state_dict reads either).
        return {"state": state, "param_groups": groups, _state.STEP_ID_KEY: self.step_id}

    def load_state_dict(self, state_dict):
        """Checks ``state_dict`` (torch.optim's format: ours, or a
        torch.optim.Muon / AdamW one, whose state is converted to fp32 and
        whose missing step id keeps this optimizer's), then imports the state
        into every daemon all or nothing and sets the groups' options and the
        step id. On any error nothing changes (ValueError naming the param and
        the rule for a bad state dict)."""
        _process_guard.check_creator_process(self._creator_pid, "load_state_dict()")
        self._ensure_registered()
        groups, states = self._check_state_dict(state_dict)
        step_ids = {_groups.check_step_id(g[_state.STEP_ID_KEY]) for g in state_dict["param_groups"]
                    if _state.STEP_ID_KEY in g}
        if not step_ids and _state.STEP_ID_KEY in state_dict:
            step_ids = {_groups.check_step_id(state_dict[_state.STEP_ID_KEY])}
        if len(step_ids) > 1:
            raise ValueError(f"param_groups disagree on {_state.STEP_ID_KEY}: {sorted(step_ids)}")
        step_id = int(step_ids.pop()) if step_ids else self.step_id
        self._push_state(states, step_id)
        for group, saved in zip(self.param_groups, groups):
            group.update(saved)
        self.step_id = step_id

    def _check_state_dict(self, state_dict):
        """(each group's options to apply, param name -> fp32 state), or a
        ValueError naming what is wrong; nothing changes here."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("state_dict must have 'state' and 'param_groups' (torch.optim's "
                             "format: opt.state_dict())")
        saved_groups = list(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this "
                             f"optimizer has {len(self.param_groups)}")
        by_index, groups = {}, []
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {gi}: loaded group has {len(saved['params'])} "
                                 f"params, this optimizer's has {len(group['params'])}")
            if saved.get("algorithm", group["algorithm"]) != group["algorithm"]:
                raise ValueError(f"param group {gi}: algorithm {saved['algorithm']!r} in the "
                                 f"state dict, {group['algorithm']!r} here")
            for index, p in zip(saved["params"], group["params"]):
                by_index[index] = self._param_names[id(p)]
            groups.append(_groups.loaded_options(gi, group, saved))
            # Types and finiteness here; bounds (momentum < 1, ...) are the
            # daemon's and step() names them.
            _groups.check_live(gi, {**group, **groups[-1]})
        unknown = sorted(set(state_dict["state"]) - set(by_index), key=str)
        if unknown:
            raise ValueError(f"state for param indices {unknown} that no param group lists")
        states = {by_index[i]: s for i, s in state_dict["state"].items()}
        return groups, _state.validate(self._param_infos(), states)

    def __getstate__(self):
        raise TypeError(
            "muond.torch.Muon cannot be pickled (torch.save(opt), copy.deepcopy): its state "
            "lives in the daemons and its params in memory registered with them. Save "
            "opt.state_dict() instead and load it into a new muond.torch.Muon with "
            "load_state_dict()")

    def add_param_group(self, param_group):
        """torch.optim's add_param_group, also after construction (progressive
        unfreezing): the registered groups are checked as step() checks them
        and the new group (torch's checks, algorithm, dtype, Muon params 2-D,
        names, hyperparameter types) here first (a refusal changes nothing),
        then the state of every daemon is exported,
        the params unregistered, all groups placed and registered again
        (placement may move params between daemons; the old groups with the
        live values they were last registered with), the old params' state
        imported (the new params start from zero, as in torch.optim) and the
        step id kept. In local mode every trainer of the domain must call it
        together, with matching groups. If the re-registration fails, the old
        groups are registered again with their state and the error is raised;
        if that fails too, AddParamGroupError: the optimizer is closed and
        unregistered, and the error's ``state_dict`` resumes a new one."""
        if getattr(self, "_closed", False):
            raise RuntimeError("muond.torch.Muon.add_param_group after close()")
        if not getattr(self, "_registered", False):  # torch.optim.Optimizer.__init__
            if isinstance(param_group, dict):
                param_group = _groups.from_torch_keys(param_group)
            super().add_param_group(param_group)
            _groups.with_torch_keys(self.param_groups[-1])
            return
        _process_guard.check_creator_process(self._creator_pid, "add_param_group()")
        kept = len(self.param_groups)

        def checked_new_group():
            self._check_registered_groups()
            return self._checked_new_group(param_group)

        # Every trainer calls it together: a group refused on one rank is
        # raised on all, before any of them unregisters.
        new_group = self._checked_on_every_rank("add_param_group", checked_new_group)
        self._register_again(lambda: self.param_groups.append(new_group),
                             lambda: self.param_groups.__delitem__(slice(kept, None)),
                             "add_param_group")

    def _checked_on_every_rank(self, what: str, check):
        """check()'s result. Its refusal (a TypeError or ValueError, or a
        sparse grad's RuntimeError, raised before anything changed) is
        raised on every rank of a collective layout (collective.agree), so
        no rank goes on to a collective the others left."""
        try:
            result, refused = check(), None
        except (TypeError, ValueError, RuntimeError) as e:
            result, refused = None, e
        if self._layout.collective:
            _collective.agree(refused, self._rank, what)
        elif refused is not None:
            raise refused
        return result

    def _checked_new_group(self, param_group) -> dict:
        """The group add_param_group would append, checked (torch's checks,
        then muond's); param_groups as they were."""
        if isinstance(param_group, dict) and param_group.get("algorithm") == "adamw":
            _groups.check_adamw_keys(len(self.param_groups), param_group)
            param_group = {**self._adamw_defaults, **param_group}
        kept = len(self.param_groups)
        if isinstance(param_group, dict):
            param_group = _groups.from_torch_keys(param_group)
        super().add_param_group(param_group)  # torch's checks; appends on success
        _groups.with_torch_keys(self.param_groups[-1])
        new_group = self.param_groups.pop()  # back only once registered
        _groups.check_new_group(kept, new_group, self.param_groups, [
            *self._param_names.values(), *(w for ms in self._matrices.values() for w, _ in ms)])
        return new_group

    def _register_again(self, change, undo, what: str) -> None:
        """Exports every daemon's state, applies ``change`` (to the groups or
        their placement), and places and registers every group again with
        that state (the step id kept). If that fails: ``undo``, the old
        groups registered again with their state, and the error raised; if
        that fails too, AddParamGroupError: the optimizer is closed and
        unregistered, and the error's ``state_dict`` resumes a new one."""
        self._memory.follow_rebound_params(self._param_names)
        self.state.push_if_assigned()
        step_id = self.step_id
        if getattr(self, "_registered_live", None) is None:
            self._registered_live = dict(self._placed_live)  # the constructor's
        before = self._registered_live
        by_param = self._fetch_state()
        # DTensors stay where they are (their mesh names the device).
        old = {self._param_names[id(p)]: {k: v if is_dtensor(v) else v.cpu()
                                          for k, v in s.items()}
               for p, s in by_param.items()}
        saved = self._pack_state_dict(by_param)  # handed out if all else fails
        change()
        try:
            self._reregister(old, step_id)
        except BaseException as error:
            undo()
            self._registered_live = before
            try:
                self._reregister(old, step_id)
            except Exception as again:
                self.close()  # unregisters everywhere (best effort): a new optimizer can
                raise AddParamGroupError(
                    f"{what} failed ({error}) and registering the old groups "
                    f"again failed too ({again}); this optimizer is closed and unregistered. "
                    "Its state is in this error's .state_dict: build a new muond.torch.Muon "
                    "with the old groups and call load_state_dict(error.state_dict)",
                    saved) from error
            raise

    def _reregister(self, states_by_name: dict, step_id: int) -> None:
        """Unregisters, places and registers every group anew (fresh buffers;
        values and accumulated grads carried over), then imports
        ``states_by_name`` (params without an entry start from zero)."""
        params = [p for group in self.param_groups for p in group["params"]]
        self._on_all(lambda c: c.unregister(self.job_id, self.client_id), "UnregisterParams")
        old_buffers = self._memory.reset()  # the same buffers list the finalizer releases
        self._wire_groups, self.layouts = {}, {}
        self._param_names, self._ranks_of, self._fixed, self._matrices = {}, {}, {}, {}
        self.state.invalidate()
        try:
            per_rank = self._place_params()  # copies values and grads into fresh buffers
        finally:
            # Also when the placement is refused: reset() took the old buffers
            # out of the list close() releases, so unreleased here their shm
            # names would outlive the trainer. The params keep their values
            # through their own views, which the rollback's placement copies.
            release(old_buffers)
        self._on_all(lambda c, r: c.register(self.job_id, per_rank[r], self.client_id,
                                             regions=self._regions.used_by(per_rank[r])),
                     "RegisterParams", with_rank=True)
        for c in self.clients:
            c.wait_healthy(self._wait_healthy_timeout, need_plan=True)
        self._on_cuda = self._memory.any_cuda()
        self._open_step_channel(per_rank)  # sized for the groups registered now
        self._registered_live = dict(self._placed_live)
        known = {self._param_names[id(p)] for p in params}
        states = _state.validate(self._param_infos(),
                                 {n: s for n, s in states_by_name.items() if n in known})
        self._push_state(states, step_id)
        self.step_id = step_id

    def close(self) -> None:
        """Unregisters from every daemon and unlinks the shm names. The model
        keeps its (now private) memory and works on; this optimizer does not."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # unregisters, closes the channels, frees the shm

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

