"""A loss the model computes itself with F.cross_entropy, on DTensor logits, is the one-device loss: the mean
over every rank's non-ignored tokens, where the ranks hold different numbers of them, with or without label
smoothing and class weights. 4 gloo processes against one; loss and gradients within 1e-5 (fp32), on a
data-parallel spec and with the vocab split over tp."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from tests.dist_utils import run_distributed
from tests.spmd_cases import norm_rel_err

VOCAB, DIM, BATCH, SEQ = 32, 16, 8, 6


class _Bigram(nn.Module):
    """Embedding, an MLP and a head; the loss in its forward, as nanoGPT writes it."""

    def __init__(self, label_smoothing: float, weighted: bool, form: str = "flat"):
        super().__init__()
        self.label_smoothing, self.form = label_smoothing, form
        # class weights (a buffer, replicated): one device divides by the sum of the counted targets' weights
        self.register_buffer("class_weight", 0.5 + torch.arange(VOCAB) / VOCAB if weighted else None)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        spmd.annotate(self.embedding.weight, "vocab", "embed")
        spmd.annotate(self.up.weight, "mlp", "embed")
        spmd.annotate(self.down.weight, "embed", "mlp")
        spmd.annotate(self.head.weight, "vocab", "embed")

    def forward(self, tokens, targets):
        logits = self.head(self.down(torch.tanh(self.up(self.embedding(tokens)))))
        if self.form == "classes second":  # [B, V, T] logits against [B, T] targets
            return F.cross_entropy(
                logits.transpose(1, 2),
                targets,
                weight=self.class_weight,
                ignore_index=-1,
                label_smoothing=self.label_smoothing,
            )
        if self.form == "log-probabilities":
            return F.nll_loss(
                F.log_softmax(logits, -1).view(-1, VOCAB), targets.view(-1), weight=self.class_weight, ignore_index=-1
            )
        return F.cross_entropy(
            logits.view(-1, VOCAB),
            targets.view(-1),
            weight=self.class_weight,
            ignore_index=-1,
            label_smoothing=self.label_smoothing,
        )


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # rank r's two rows keep 1 + r, 2 + r tokens: 3, 5, 7 and 9 counted tokens on the four ranks
    keep = torch.arange(SEQ) < (1 + torch.arange(BATCH) // 2 + torch.arange(BATCH) % 2).unsqueeze(1)
    return tokens, targets.masked_fill(~keep, -1)


def _matches_one_device(rank, world, spec, label_smoothing, weighted, form="flat"):
    sizes, _ = spmd.parse_spec(spec)
    mesh = spmd.make_mesh(sizes)
    torch.manual_seed(0)
    ref = _Bigram(label_smoothing, weighted, form)
    torch.manual_seed(0)
    model = spmd.parallelize(_Bigram(label_smoothing, weighted, form), mesh, spmd.Rules.default())
    tokens, targets = _batch()
    n = spmd.Rules.default().data_parallel_size(mesh)
    r = spmd.Rules.default().data_parallel_rank(mesh)
    rows = slice(r * BATCH // n, (r + 1) * BATCH // n)
    loss, ref_loss = model(tokens[rows], targets[rows]), ref(tokens, targets)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item(), (spec, loss.item(), ref_loss.item())
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        err = norm_rel_err(p.grad.full_tensor(), ref_params[name].grad)
        assert err <= 1e-5, f"{spec}: gradient of {name} off by {err:.2e}"


def _each_case(rank, world, cases):
    for case in cases:
        _matches_one_device(rank, world, *case)


SPECS = ("dp=4", "dp=2,tp=2")


def test_uneven_ignored_tokens_give_the_one_device_loss():
    """With and without label smoothing and class weights, on each of SPECS: all in one launch."""
    combos = [(0.0, False), (0.1, False), (0.0, True), (0.1, True)]
    run_distributed(_each_case, 4, [(spec, *c) for c in combos for spec in SPECS], timeout_s=300)


def test_other_forms_of_the_loss_give_the_one_device_loss():
    """The class dim second ([B, V, T] logits), and F.nll_loss on log-probabilities; all in one launch."""
    combos = [
        (0.0, False, "classes second"),
        (0.1, True, "classes second"),
        (0.0, False, "log-probabilities"),
        (0.0, True, "log-probabilities"),
    ]
    run_distributed(_each_case, 4, [(spec, *c) for c in combos for spec in SPECS], timeout_s=300)
