"""The usual step sent before step()'s checks (``overlap_checks``): the checks
of the params and grads (~0.4 ms of Python a step for 388 params) run while
the daemon runs the step, instead of before it is sent. The daemon runs
its momentum phase and domain agreements, writing nothing, and waits for the
checks' verdict before the job vote (StepRequest.await_trainer_verdict,
through the step channel; docs/ARCHITECTURE.md "The step channel").

Only the usual step goes so: one daemon whose channel takes verdicts, plain
params (no DTensor, FSDP2 or split QKV param, whose values step() copies in
first), grads that backward wrote in place at the last step and now (so a
trainer whose zero_grad() sets them to None never pays a withdrawn step), no
state read or assigned since (it may have to be pushed first), no QK-clip,
and a step checked first before it (its skip lists are not known till then).
A frozen param must have no grad: one that keeps its zeroed grad keeps every
step checked first. A step the checks find something to do for (a grad
moved, a param rebound, a param frozen) is withdrawn, nothing applied, and
step() sends it again after the checks; one whose check raises is withdrawn
and refused, as when the check raises before sending."""
from __future__ import annotations

import time

import torch

from muond.client import STEP_WITHDRAWN, MuondError
from muond.torch import rpc as _rpc
from muond.torch import wire as _wire


class ChecksAlongside:
    """One optimizer's record of its last step for sending the next one
    before its checks, and the sending."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._sent_skipped: list | None = None  # per daemon, the last step's skip list
        self._grads_were_in_place = False  # the last step's checks found them so

    def checked_first(self, skipped: list, grads_in_place: bool) -> None:
        """step() checked a step first and sends it with ``skipped``."""
        self._sent_skipped, self._grads_were_in_place = skipped, grads_in_place

    def applies(self, opt, qk_max_logits) -> bool:
        """Whether ``opt``'s coming step is the usual one (module docstring)."""
        return (self.enabled and self._grads_were_in_place and self._sent_skipped is not None
                and qk_max_logits is None and opt._qk_clip is None
                and len(opt.clients) == 1 and opt.clients[0].takes_trainer_verdicts
                and opt._memory.only_rebound() and opt._memory.first_grad_in_place()
                and not opt.state.cached())

    def step(self, opt, qk_max_logits) -> bool:
        """``opt``'s step sent before its checks, when it is the usual one.
        True: applied. False: step() checks first and sends as usual (not the
        usual step, or withdrawn: nothing was applied). What a check raises
        is raised, the step refused on every rank."""
        if not self.applies(opt, qk_max_logits):
            return False
        client, step_id, sent = opt.clients[0], opt.step_id + 1, self._sent_skipped
        try:
            overrides = opt._overrides(0)
        except Exception:  # noqa: BLE001 (a bad hyperparameter: step()'s checks name it)
            return False
        if opt._on_cuda:
            torch.cuda.synchronize()  # the daemon reads grads from another process
        failed: list[Exception] = []

        def checks() -> bool:
            try:
                go = self._nothing_to_do(opt, sent)
            except Exception as e:  # noqa: BLE001 (withdrawn, then raised below)
                failed.append(e)
                go = False
            if not go:
                # The next attempt checks first (and learns the skip lists).
                self._sent_skipped = None
            return go

        t0 = time.perf_counter()
        try:
            response = _rpc.result(
                lambda: client.step_with_checks(opt.job_id, step_id, checks, overrides,
                                                opt.client_id, sent[0]),
                client, f"Step {step_id}")
        except MuondError as e:
            if failed:
                # Withdrawn (the answer says so): every rank sends the step
                # again, and this refusal fails it on all of them at once. Any
                # other answer failed the step on every rank already.
                if e.reason == STEP_WITHDRAWN:
                    opt._send_refusal(failed[0])
                raise failed[0] from None
            if e.reason == STEP_WITHDRAWN:
                return False  # withdrawn here or on another rank: sent again, as usual
            opt._replays.sent_without_answer(step_id)
            raise
        except BaseException:
            opt._replays.sent_without_answer(step_id)
            raise
        if failed:  # checks run only once sent, and a withdrawn step is never applied
            raise RuntimeError(f"muond daemon {client.address} applied step {step_id}, which "
                               "this trainer withdrew") from failed[0]
        if response is None:
            return False  # not sent (the channel unusable): as usual
        opt.state.invalidate()  # the step changed the state: read it afresh
        opt._finish_step(step_id, [response], t0, [])
        return True

    def _nothing_to_do(self, opt, sent: list) -> bool:
        """step()'s checks (raising as there), changing nothing: true when
        the step needs nothing done before the daemon reads the memory (every
        grad in place, no param rebound, the skip lists still ``sent``)."""
        self._grads_were_in_place = opt._check_registered_groups()
        if not self._grads_were_in_place or not opt._memory.rebound_intact():
            return False
        # With every grad in place and only rebound params, the step's skip
        # lists are the frozen params' (what skipped_and_copy_grads returns
        # then, copying nothing).
        skipped = _wire.matrices_of(
            opt._memory.frozen_skips(opt._param_names, opt._ranks_of, 1), opt._matrices)
        return skipped == sent
