"""MTP proposer: the target checkpoint's own multi-token-prediction layers (spec/mtp_head.py)
propose k tokens greedily from the target's last hidden states.

An MTP head is fed as an EAGLE head is (spec/eagle.py): the runner hands out the target's
final hidden state of every row it computes, the head catches up over the pairs
(h_p, x_{p+1}) of each step's new positions in its own paged KV cache (a layer per MTP layer,
in the slots of the request's own blocks), its last catch-up row gives the first proposal and
k - 1 single-row steps on its own output give the rest. What differs is the model: the MTP
layers come from the target's folder (no "model" key), step j runs MTP layer j mod their
number (one trained layer runs k times), and the head's output passes its own final norm.
Catch-up rows run layer 0 only: with several MTP layers, layer j >= 1 attends to the KV of the
positions its own proposal steps wrote, which only makes proposals worse, never the output
different (acceptance keeps the target's tokens).

On a hybrid target the verify step's linear-attention state is rolled back to the last kept
token as for any proposer (state_rollback.py).
"""

from __future__ import annotations

from voltserve.services.executor.spec.eagle import EagleProposer
from voltserve.services.executor.spec.mtp_head import load_mtp_head


class MtpProposer(EagleProposer):
    what = "mtp"
    head_name = "the MTP layers"
    # The MTP layers sit in the target's folder, whose KV scales are the target layers' (by
    # index): their own e4m3 cache takes 1.0.
    kv_scales_dir = None

    def _load_head(self, runner):
        self.path = runner.config.model  # the target's own folder
        return load_mtp_head(self.path, runner.arch, runner.dtype, runner.device)
