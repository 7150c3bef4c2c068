"""muond.torch.tensor_layout.SameLayout: torch's C++ guards and the Python
passes give the same answer for every change the per-step checks must see
(address, sizes, strides, dtype, requires_grad, count), and the fallback
answers alone when the guards are unavailable."""
import unittest
from unittest import mock

import torch

from muond.torch import tensor_layout


def changes(seen, base):
    """(what, tensors): each a list like ``seen`` with one thing changed."""
    first = seen[0]
    return [
        ("another address", [base[64:76].view(3, 4)] + seen[1:]),
        ("another shape", [first.view(4, 3)] + seen[1:]),
        ("transposed strides", [first.t().contiguous().t()] + seen[1:]),
        ("another dtype at the address", [first.view(torch.int32)] + seen[1:]),
        ("requires_grad", [first.detach().requires_grad_()] + seen[1:]),
        ("the last one moved", seen[:-1] + [base[80:92].view(3, 4)]),
        ("one fewer", seen[:-1]),
        ("one more", seen + [first]),
        ("a non-tensor", [3] + seen[1:]),
    ]


class SameLayoutTest(unittest.TestCase):

    def setUp(self):
        self.base = torch.zeros(128)
        self.seen = [self.base[i * 12:(i + 1) * 12].view(3, 4) for i in range(4)]

    def check_answers(self, layout):
        self.assertTrue(layout.holds(list(self.seen)))
        # Other tensor objects of the same layout (views made afresh) hold.
        self.assertTrue(layout.holds([t.view(3, 4) for t in self.seen]))
        for what, tensors in changes(self.seen, self.base):
            with self.subTest(what):
                self.assertFalse(layout.holds(tensors))

    def test_this_torch_checks_in_cpp(self):
        # A torch whose private guard API moved still works (the fallback),
        # but every step then pays the Python passes: say so here.
        self.assertTrue(tensor_layout.native_usable(),
                        f"torch {torch.__version__}: TensorGuards or "
                        "_tensors_data_ptrs_at_indices_equal unusable")
        self.assertTrue(tensor_layout.SameLayout(self.seen).native)

    def test_the_guards_see_every_change(self):
        self.check_answers(tensor_layout.SameLayout(self.seen))

    def test_without_the_guards_the_passes_answer(self):
        with mock.patch.object(tensor_layout, "native_usable", return_value=False):
            layout = tensor_layout.SameLayout(self.seen)
        self.assertFalse(layout.native)
        self.check_answers(layout)

    def test_params_and_grads_of_a_model(self):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        params = list(model.parameters())
        layout = tensor_layout.SameLayout(params)
        self.assertTrue(layout.holds(params))
        params[0].requires_grad_(False)  # frozen since: not the layout seen
        self.assertFalse(layout.holds(params))
        params[0].requires_grad_(True)
        params[2].data = torch.zeros(3, 4)  # re-pointed: another address
        self.assertFalse(layout.holds(params))


class LayoutCacheTest(unittest.TestCase):
    """LayoutCache answers as the caller's passes do; where a layout just
    taken keeps failing on what the passes do not look at (requires_grad
    flipped at every step) it stops taking new ones, and a failing pass
    re-arms it."""

    def test_it_answers_as_the_passes_and_stops_retaking_a_failing_layout(self):
        seen = [torch.zeros(3, 4), torch.zeros(3, 4)]
        cache = tensor_layout.LayoutCache()
        verdict = [True]
        with mock.patch.object(tensor_layout, "SameLayout",
                               wraps=tensor_layout.SameLayout) as made:
            self.assertTrue(cache.holds(seen, lambda: verdict[0]))  # taken
            self.assertTrue(cache.holds(seen, lambda: self.fail("not asked")))
            seen[0] = seen[0].detach()
            for _ in range(4):
                seen[0].requires_grad_(not seen[0].requires_grad)
                self.assertTrue(cache.holds(seen, lambda: verdict[0]))
            self.assertEqual(made.call_count, 3)  # the first, then two retries
            verdict[0] = False
            self.assertFalse(cache.holds(seen, lambda: verdict[0]))
            verdict[0] = True
            self.assertTrue(cache.holds(seen, lambda: verdict[0]))  # re-armed
            self.assertEqual(made.call_count, 4)


if __name__ == "__main__":
    unittest.main()
