"""1-bit Adam in one process with no communication, written from Tang et al. 2021 (Algorithm 1) and the
choices spmd.OneBitAdam documents: N simulated workers each hand in their local gradient, and the worker
and server compressions and error feedbacks are spelled out on plain tensors, loop by loop.

    warm-up (t <= Tw):  g = 1/N sum_i g_i;  AdamW (m, v, bias corrections, decoupled weight decay)
    after:              m_i = b1 m + (1-b1) g_i
                        x_i = m_i + e_i;  xhat_i = C(x_i) chunk by chunk;  e_i = x_i - xhat_i     (worker)
                        chunk r: z_r = 1/N sum_i xhat_i[r] + s_r;  C(z_r);  s_r = z_r - C(z_r)  (server r)
                        m = [C(z_0), ..., C(z_N-1)];  w = w(1 - lr wd) - lr (m/(1-b1^t)) / (sqrt(v/(1-b2^Tw)) + eps)

C(x) = mean(|x|) * sign(x), sign(0) = +1; vectors are zero-padded to a multiple of 8N and cut into N chunks.
"""

import math

import torch


def compress(x: torch.Tensor) -> torch.Tensor:
    return x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)


class ReferenceOneBitAdam:
    def __init__(self, model, workers, lr, betas, eps, weight_decay, warmup):
        self.params = dict(model.named_parameters())
        self.n, self.lr, (self.b1, self.b2), self.eps, self.wd, self.warmup = (
            workers,
            lr,
            betas,
            eps,
            weight_decay,
            warmup,
        )
        self.t = 0
        self.m = {k: torch.zeros_like(p) for k, p in self.params.items()}
        self.v = {k: torch.zeros_like(p) for k, p in self.params.items()}
        unit = 8 * workers
        self.padded = {k: math.ceil(p.numel() / unit) * unit for k, p in self.params.items()}
        self.worker_error = [{k: torch.zeros(n) for k, n in self.padded.items()} for _ in range(workers)]
        self.server_error = [{k: torch.zeros(n // workers) for k, n in self.padded.items()} for _ in range(workers)]

    @torch.no_grad()
    def step(self, worker_grads: list[dict]):
        """`worker_grads[i][name]`: worker i's gradient of its own batch slice."""
        self.t += 1
        for name, p in self.params.items():
            decay = self.wd if p.dim() >= 2 else 0.0
            p.mul_(1 - self.lr * decay)
            if self.t <= self.warmup:
                g = sum(wg[name] for wg in worker_grads) / self.n
                self.m[name] = self.b1 * self.m[name] + (1 - self.b1) * g
                self.v[name] = self.b2 * self.v[name] + (1 - self.b2) * g * g
                v_hat = self.v[name] / (1 - self.b2**self.t)
            else:
                self.m[name] = self._compressed_average(name, [wg[name] for wg in worker_grads])
                v_hat = self.v[name] / (1 - self.b2**self.warmup)
            m_hat = self.m[name] / (1 - self.b1**self.t)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))

    def _compressed_average(self, name, grads):
        n, numel, chunk = self.n, self.params[name].numel(), self.padded[name] // self.n
        sent = []  # sent[i][r]: worker i's compressed chunk r
        for i in range(n):
            m_i = self.b1 * self.m[name] + (1 - self.b1) * grads[i]
            x = torch.zeros(self.padded[name])
            x[:numel] = m_i.reshape(-1)
            x = x + self.worker_error[i][name]
            xhat = torch.cat([compress(x[r * chunk : (r + 1) * chunk]) for r in range(n)])
            self.worker_error[i][name] = x - xhat
            sent.append([xhat[r * chunk : (r + 1) * chunk] for r in range(n)])
        served = []
        for r in range(n):
            z = sum(sent[i][r] for i in range(n)) / n + self.server_error[r][name]
            served.append(compress(z))
            self.server_error[r][name] = z - served[-1]
        return torch.cat(served)[:numel].view_as(self.params[name])
