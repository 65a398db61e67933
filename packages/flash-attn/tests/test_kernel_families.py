"""Every kernel family the chooser (choose.py) can take on an sm_90 GPU, run the three ways
users run it: eager, `torch.compile(fullgraph=True)` with Inductor, and captured in a CUDA graph,
forward and backward, each against the float64 reference by FlashAttention's accuracy rule.

The families come from the chooser itself: `test_every_family_has_a_case` sweeps the host
path over the options it reads (head dim, dtype, causal, window, softcap, packing with or
without seqused_k, lengths, deterministic) as on an H100 (`config.H100`: sm_90, 132 SMs), and
fails when a family appears that no case in FAMILY_CASES takes. Each case states the
(forward, backward) families it takes, checked here on CPU (`target=H100`) and again on the GPU
(its own target) before it runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from attn_cases import Call, check_call, fwd_bwd
from torch._subclasses.fake_tensor import FakeTensorMode

from kernelkit.flash_attn import FlashAttentionFunction, explain, families
from kernelkit.flash_attn import tables as T
from kernelkit.flash_attn.config import H100, Target, Varlen
from kernelkit.flash_attn.validation import window_for

SM90_SMS = 132  # H100 SXM and H200
assert H100.sms == SM90_SMS and H100.gluon
LENGTHS = ((300, 280), (1, 3), (0, 5), (200, 200))  # (Nq, Nk) per sequence: 1 key, no query
USED = (150, 0, 5, 137)  # seqused_k of LENGTHS: fewer keys than Nq, none, all, fewer
WIN = (64, -1)
# a causal window too long for the d64 fused-dq backward's persistent walk
LONG_WIN = (T.FUSED_PERSISTENT_MAX_WINDOW[64], -1)
DEC = dict(b=2, nq=1, nk=4096, h=8, hkv=2, d=64)  # decoding: split-KV
DEC1 = dict(DEC, nk=200)  # one split (direct): a short cache
WIN1 = (256, -1)  # one split of a long cache: the window's keys
P64 = dict(b=2, nq=300, nk=300, h=4, hkv=2, d=64)
P128 = dict(b=2, nq=300, nk=300, h=4, hkv=2, d=128)
E128 = dict(b=2, nq=256, nk=256, h=4, hkv=2, d=128)  # an even number of query blocks: pairs
N128 = dict(nq=2176, nk=2176, h=2, hkv=2, d=128)  # d128: dq summed by the consumers (fixed order)
ANY128 = dict(N128, deterministic=False)  # and in any order
# d128 past tables.FUSED_PERSISTENT_MAX_N[64] rows (in the fixed order walked from a counter at
# any length; in any order one program per tile), and a causal window too long for the window's
# walk
L128 = dict(nq=8448, nk=8448, h=2, hkv=2, d=128)
LONG_WIN128 = (T.FUSED_PERSISTENT_MAX_WINDOW[128], -1)
GQA128 = dict(nq=4224, nk=4224, d=128)  # GQA causal in a fixed order: the dq kernel beside
N64 = dict(
    nq=8448, nk=8448, h=6, hkv=2
)  # d64: the fused-dq Gluon backward, in a fixed order, per tile where causal
ANY64 = dict(nq=4096, nk=4096, deterministic=False)  # and in any order
# in any order with a causal window too long for the walk (tables.FUSED_PERSISTENT_MAX_WINDOW)
ANYL64 = dict(nq=8448, nk=8448, h=4, hkv=2, deterministic=False)
S64 = dict(nq=4096, nk=4096, h=6, hkv=2)  # d64 fixed order, walked (FUSED_PERSISTENT_MAX_N)
CAP_MAX = 60.0  # a softcap above the fixed shift's bound: the forward keeps the running maximum
MLA = dict(b=2, nq=300, nk=300, h=4, hkv=2, d=192, dv=128)  # a value head dim of its own

# (forward family, backward family, a call that takes them). bwd-gluon "persistent" (the dq
# kernel beside it) takes fewer than tables.FUSED_DQ_MIN_N rows at d128, fused dq (dq-ordered
# / dq-any-order; dq-halves at d128) at least tables.FUSED_DQ_MIN_N / ANY_ORDER_DQ_MIN_N; the d64 Gluon forward needs
# tables.GLUON_FWD_MIN_N rows and a grid that fills the GPU (tables.SMALL_GRID_FWD,
# choose._small_grid).
FAMILY_CASES = [
    ("fwd", "bwd", Call(**P64)),
    ("fwd(local)", "bwd(local)", Call(**P64, window=WIN)),
    ("fwd(softcap,fixed-shift)", "bwd(softcap)", Call(**P64, softcap=5.0)),
    ("fwd(local,softcap,fixed-shift)", "bwd(local,softcap)", Call(**P64, window=WIN, softcap=5.0)),
    ("fwd(varlen)", "bwd(varlen)", Call(h=4, hkv=2, lengths=LENGTHS)),
    ("fwd(local,varlen)", "bwd(local,varlen)", Call(h=4, hkv=2, lengths=LENGTHS, window=WIN)),
    ("fwd(varlen,softcap,fixed-shift)", "bwd(varlen,softcap)", Call(h=4, hkv=2, lengths=LENGTHS, softcap=5.0)),
    ("fwd(local,varlen,softcap,fixed-shift)", "bwd(local,varlen,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, window=WIN, softcap=5.0)),
    ("fwd(varlen,seqused)", "bwd(varlen,seqused)", Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED)),
    ("fwd(local,varlen,seqused)", "bwd(local,varlen,seqused)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, window=WIN)),
    ("fwd(varlen,seqused,softcap,fixed-shift)", "bwd(varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, softcap=5.0)),
    ("fwd(local,varlen,seqused,softcap,fixed-shift)", "bwd(local,varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, window=WIN, softcap=5.0)),
    ("fwd(causal)", "bwd(causal)", Call(**P64, causal=True)),
    ("fwd(causal,local)", "bwd(causal,local)", Call(**P64, causal=True, window=WIN)),
    ("fwd(causal,softcap,fixed-shift)", "bwd(causal,softcap)", Call(**P64, causal=True, softcap=5.0)),
    ("fwd(causal,local,softcap,fixed-shift)", "bwd(causal,local,softcap)",
     Call(**P64, causal=True, window=WIN, softcap=5.0)),
    ("fwd(causal,varlen)", "bwd(causal,varlen)", Call(h=4, hkv=2, lengths=LENGTHS, causal=True)),
    ("fwd(causal,local,varlen)", "bwd(causal,local,varlen)",
     Call(h=4, hkv=2, lengths=LENGTHS, causal=True, window=WIN)),
    ("fwd(causal,varlen,softcap,fixed-shift)", "bwd(causal,varlen,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, causal=True, softcap=5.0)),
    ("fwd(causal,local,varlen,softcap,fixed-shift)", "bwd(causal,local,varlen,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, causal=True, window=WIN, softcap=5.0)),
    ("fwd(causal,varlen,seqused)", "bwd(causal,varlen,seqused)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, causal=True)),
    ("fwd(causal,local,varlen,seqused)", "bwd(causal,local,varlen,seqused)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, causal=True, window=WIN)),
    ("fwd(causal,varlen,seqused,softcap,fixed-shift)", "bwd(causal,varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, causal=True, softcap=5.0)),
    ("fwd(causal,local,varlen,seqused,softcap,fixed-shift)", "bwd(causal,local,varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, causal=True, window=WIN, softcap=5.0)),
    ("fwd-split", "bwd", Call(**DEC)),
    ("fwd-split(local)", "bwd(local)", Call(**DEC, window=(1000, -1))),
    ("fwd-split(softcap)", "bwd(softcap)", Call(**DEC, softcap=5.0)),
    ("fwd-split(local,softcap)", "bwd(local,softcap)", Call(**DEC, window=(1000, -1), softcap=5.0)),
    ("fwd-split(causal)", "bwd(causal)", Call(**DEC, causal=True)),
    ("fwd-split(causal,local)", "bwd(causal,local)", Call(**DEC, causal=True, window=(1000, -1))),
    ("fwd-split(causal,softcap)", "bwd(causal,softcap)", Call(**DEC, causal=True, softcap=5.0)),
    ("fwd-split(causal,local,softcap)", "bwd(causal,local,softcap)",
     Call(**DEC, causal=True, window=(1000, -1), softcap=5.0)),
    ("fwd-split(direct)", "bwd", Call(**DEC1)),
    ("fwd-split(local,direct)", "bwd(local)", Call(**DEC, window=WIN1)),
    ("fwd-split(softcap,direct)", "bwd(softcap)", Call(**DEC1, softcap=5.0)),
    ("fwd-split(local,softcap,direct)", "bwd(local,softcap)", Call(**DEC, window=WIN1, softcap=5.0)),
    ("fwd-split(causal,direct)", "bwd(causal)", Call(**DEC1, causal=True)),
    ("fwd-split(causal,local,direct)", "bwd(causal,local)", Call(**DEC, causal=True, window=WIN1)),
    ("fwd-split(causal,softcap,direct)", "bwd(causal,softcap)", Call(**DEC1, causal=True, softcap=5.0)),
    ("fwd-split(causal,local,softcap,direct)", "bwd(causal,local,softcap)",
     Call(**DEC, causal=True, window=WIN1, softcap=5.0)),
    ("fwd-gluon(d128)", "bwd-gluon(d128,dq-kernel,persistent)", Call(**P128)),
    ("fwd-gluon(d128,causal)", "bwd-gluon(d128,causal,dq-kernel,persistent)",
     Call(**P128, causal=True)),
    ("fwd-gluon(d128,causal,pairs)", "bwd-gluon(d128,causal,dq-kernel,persistent)",
     Call(**E128, causal=True, dtype=torch.float16)),
    ("fwd-gluon(d128,softcap,fixed-shift)", "bwd-gluon(d128,softcap,dq-kernel,persistent)",
     Call(**P128, softcap=5.0)),
    ("fwd-gluon(d128,causal,softcap,fixed-shift)", "bwd-gluon(d128,causal,softcap,dq-kernel,persistent)",
     Call(**P128, causal=True, softcap=5.0)),
    ("fwd-gluon(d128,causal,pairs,softcap,fixed-shift)", "bwd-gluon(d128,causal,softcap,dq-kernel,persistent)",
     Call(**E128, causal=True, softcap=5.0)),
    ("fwd-gluon(d128,local,dynamic)", "bwd-gluon(d128,local,dq-kernel,persistent)",
     Call(**P128, window=WIN)),
    ("fwd-gluon(d128,local,softcap,fixed-shift,dynamic)", "bwd-gluon(d128,local,softcap,dq-kernel,persistent)",
     Call(**P128, window=WIN, softcap=5.0)),
    ("fwd-gluon(d128,causal,local,dynamic)", "bwd-gluon(d128,causal,local,dq-kernel,persistent)",
     Call(**P128, causal=True, window=WIN)),
    ("fwd-gluon(d128,causal,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d128,causal,local,softcap,dq-kernel,persistent)",
     Call(**P128, causal=True, window=WIN, softcap=5.0)),
    # d128 in the fixed order: walked from the counter at any length (tables.FUSED_PERSISTENT_MAX_N)
    ("fwd-gluon(d128)", "bwd-gluon(d128,dq-ordered,dq-halves,persistent,dynamic)", Call(**N128)),
    ("fwd-gluon(d128,causal)", "bwd-gluon(d128,causal,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, causal=True)),
    ("fwd-gluon(d128,local,dynamic)", "bwd-gluon(d128,local,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, window=WIN)),
    # a window's right edge (the causal family, its edge off the diagonal)
    ("fwd-gluon(d128,causal)", "bwd-gluon(d128,causal,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, window=(-1, 64))),
    ("fwd-gluon(d128,causal,local,dynamic)", "bwd-gluon(d128,causal,local,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, causal=True, window=WIN)),
    # long rows with a causal window past FUSED_PERSISTENT_MAX_WINDOW[128]: walked all the same
    ("fwd-gluon(d128,causal,local,dynamic)",
     "bwd-gluon(d128,causal,local,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**L128, causal=True, window=LONG_WIN128)),
    ("fwd-gluon(d128)", "bwd-gluon(d128,dq-any-order,dq-halves)", Call(**ANY128)),
    ("fwd-gluon(d128,causal)", "bwd-gluon(d128,causal,dq-any-order,dq-halves)",
     Call(**ANY128, causal=True)),
    ("fwd-gluon(d128,local,dynamic)", "bwd-gluon(d128,local,dq-any-order,dq-halves)",
     Call(**ANY128, window=WIN)),
    ("fwd-gluon(d128,causal,local,dynamic)",
     "bwd-gluon(d128,causal,local,dq-any-order,dq-halves,persistent,dynamic)",
     Call(**ANY128, causal=True, window=WIN)),
    ("fwd-gluon(d128,causal,local,dynamic)", "bwd-gluon(d128,causal,local,dq-any-order,dq-halves)",
     Call(**L128, causal=True, window=LONG_WIN128, deterministic=False)),
    # softcap (tanh.approx) on the fused-dq d128 backward, each order
    ("fwd-gluon(d128,softcap,fixed-shift)", "bwd-gluon(d128,softcap,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, softcap=5.0)),
    ("fwd-gluon(d128,causal,softcap,fixed-shift)", "bwd-gluon(d128,causal,softcap,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, causal=True, softcap=5.0)),
    ("fwd-gluon(d128,local,softcap,fixed-shift,dynamic)", "bwd-gluon(d128,local,softcap,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, window=WIN, softcap=5.0)),
    ("fwd-gluon(d128,causal,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d128,causal,local,softcap,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**N128, causal=True, window=WIN, softcap=5.0)),
    ("fwd-gluon(d128,causal,pairs,softcap,fixed-shift)",
     "bwd-gluon(d128,causal,softcap,dq-ordered,dq-halves,persistent,dynamic)",
     Call(**L128, causal=True, softcap=5.0)),
    ("fwd-gluon(d128,softcap,fixed-shift)", "bwd-gluon(d128,softcap,dq-any-order,dq-halves)",
     Call(**ANY128, softcap=5.0)),
    ("fwd-gluon(d128,causal,softcap)", "bwd-gluon(d128,causal,softcap,dq-any-order,dq-halves)",
     Call(**ANY128, causal=True, softcap=5.0, dtype=torch.float16)),
    ("fwd-gluon(d128,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d128,local,softcap,dq-any-order,dq-halves)",
     Call(**ANY128, window=WIN, softcap=5.0)),
    ("fwd-gluon(d128,causal,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d128,causal,local,softcap,dq-any-order,dq-halves,persistent,dynamic)",
     Call(**ANY128, causal=True, window=WIN, softcap=5.0)),
    ("fwd-gluon(d128,causal,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d128,causal,local,softcap,dq-any-order,dq-halves)",
     Call(**L128, causal=True, window=LONG_WIN128, softcap=5.0, deterministic=False)),
    # GQA causal in the fixed order keeps the dq kernel at d128 (tables.ORDERED_GQA_CAUSAL_DQ_KERNEL_D)
    ("fwd-gluon(d128,causal)", "bwd-gluon(d128,causal,dq-kernel)", Call(**GQA128, causal=True)),
    ("fwd-gluon(d128,causal,softcap,fixed-shift)", "bwd-gluon(d128,causal,softcap,dq-kernel)",
     Call(**GQA128, causal=True, softcap=5.0)),
    ("fwd-gluon(d128,causal)", "bwd-gluon(d128,causal,dq-kernel,persistent)",
     Call(**dict(GQA128, nq=2176, nk=2176), window=(-1, 64))),
    # d64 non-causal in the fixed order: walked from the counter at any length
    # (tables.FUSED_PERSISTENT_MAX_N); causal past its bound (below): one program per tile
    ("fwd-gluon(d64)", "bwd-gluon(d64,dq-ordered,persistent,dynamic)", Call(**N64)),
    ("fwd-gluon(d64,local,dynamic)", "bwd-gluon(d64,local,dq-ordered,persistent,dynamic)",
     Call(**N64, window=WIN)),
    ("fwd-gluon(d64,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d64,local,softcap,dq-ordered,persistent,dynamic)",
     Call(**N64, window=WIN, softcap=5.0)),
    ("fwd-gluon(d64,causal,local,softcap,fixed-shift,dynamic)", "bwd-gluon(d64,causal,local,softcap,dq-ordered,persistent,dynamic)",
     Call(b=2, nq=2176, nk=2176, h=4, hkv=2, causal=True, window=WIN, softcap=5.0)),
    ("fwd-gluon(d64,causal,pairs)", "bwd-gluon(d64,causal,dq-ordered)",
     Call(**N64, window=(-1, 64))),
    ("fwd-gluon(d64,causal,local,dynamic)", "bwd-gluon(d64,causal,local,dq-ordered)",
     Call(**N64, causal=True, window=LONG_WIN)),
    # short causal windows: the d64 fused-dq backward walks its tiles persistently, taking
    # them from a counter
    ("fwd-gluon(d64,causal,local,dynamic)",
     "bwd-gluon(d64,causal,local,dq-ordered,persistent,dynamic)",
     Call(**N64, causal=True, window=WIN)),
    # d64 summing dq in the fixed order up to tables.FUSED_PERSISTENT_MAX_N rows (causal; the
    # rest at any length): walked from the counter too, windows or not
    ("fwd", "bwd-gluon(d64,dq-ordered,persistent,dynamic)", Call(**S64)),
    ("fwd(softcap,fixed-shift)", "bwd-gluon(d64,softcap,dq-ordered,persistent,dynamic)",
     Call(**S64, softcap=5.0)),
    ("fwd(local)", "bwd-gluon(d64,local,dq-ordered,persistent,dynamic)", Call(**S64, window=WIN)),
    ("fwd(local,softcap,fixed-shift)", "bwd-gluon(d64,local,softcap,dq-ordered,persistent,dynamic)",
     Call(**S64, window=WIN, softcap=5.0)),
    ("fwd", "bwd-gluon(d64,dq-any-order)", Call(**ANY64)),
    ("fwd(local)", "bwd-gluon(d64,local,dq-any-order)", Call(**ANY64, window=WIN)),
    ("fwd(causal)", "bwd-gluon(d64,causal,dq-any-order)", Call(**ANY64, window=(-1, 64))),
    ("fwd-gluon(d64,causal,local,dynamic)", "bwd-gluon(d64,causal,local,dq-any-order)",
     Call(**ANYL64, causal=True, window=LONG_WIN)),
    ("fwd(causal,local)", "bwd-gluon(d64,causal,local,dq-any-order,persistent,dynamic)",
     Call(**ANY64, causal=True, window=WIN)),
    ("fwd-gluon(d64,causal,pairs)", "bwd-gluon(d64,causal,dq-ordered,persistent,dynamic)",
     Call(nq=8192, nk=8192, h=4, hkv=2, causal=True, dtype=torch.float16)),
    ("fwd(causal)", "bwd-gluon(d64,causal,dq-any-order)",
     Call(nq=4096, nk=4096, causal=True, deterministic=False)),
    ("fwd-gluon(d64,causal)", "bwd-gluon(d64,causal,dq-ordered,persistent,dynamic)",
     Call(b=2, nq=2176, nk=2176, h=4, hkv=2, causal=True)),
    ("fwd-gluon(d64,causal,softcap,fixed-shift)", "bwd-gluon(d64,causal,softcap,dq-ordered,persistent,dynamic)",
     Call(b=2, nq=2176, nk=2176, h=4, hkv=2, causal=True, softcap=5.0)),
    ("fwd-gluon(d64,causal,pairs,softcap,fixed-shift)", "bwd-gluon(d64,causal,softcap,dq-ordered,persistent,dynamic)",
     Call(nq=4096, nk=4096, h=6, hkv=2, causal=True, softcap=5.0)),
    ("fwd-gluon(d64,softcap,fixed-shift)", "bwd-gluon(d64,softcap,dq-ordered,persistent,dynamic)",
     Call(**N64, softcap=5.0)),
    ("fwd-gluon(d64,causal,pairs,softcap,fixed-shift)", "bwd-gluon(d64,causal,softcap,dq-ordered)",
     Call(**N64, window=(-1, 64), softcap=5.0)),
    ("fwd-gluon(d64,causal,local,softcap,dynamic)",
     "bwd-gluon(d64,causal,local,softcap,dq-ordered)",
     Call(**N64, causal=True, window=LONG_WIN, softcap=5.0, dtype=torch.float16)),
    ("fwd-gluon(d64,causal,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d64,causal,local,softcap,dq-ordered,persistent,dynamic)",
     Call(**N64, causal=True, window=WIN, softcap=5.0)),
    ("fwd(softcap,fixed-shift)", "bwd-gluon(d64,softcap,dq-any-order)", Call(**ANY64, softcap=5.0)),
    ("fwd(local,softcap,fixed-shift)", "bwd-gluon(d64,local,softcap,dq-any-order)",
     Call(**ANY64, window=WIN, softcap=5.0)),
    ("fwd(causal,softcap,fixed-shift)", "bwd-gluon(d64,causal,softcap,dq-any-order)",
     Call(**ANY64, window=(-1, 64), softcap=5.0)),
    ("fwd-gluon(d64,causal,local,softcap,fixed-shift,dynamic)",
     "bwd-gluon(d64,causal,local,softcap,dq-any-order)",
     Call(**ANYL64, causal=True, window=LONG_WIN, softcap=5.0)),
    ("fwd(causal,local,softcap)",
     "bwd-gluon(d64,causal,local,softcap,dq-any-order,persistent,dynamic)",
     Call(**ANY64, causal=True, window=WIN, softcap=5.0, dtype=torch.float16)),
    # softcap above the fixed shift's bound (config.SHIFT_MAX_QK_SCALE): each row's running
    # maximum
    ("fwd(softcap)", "bwd(softcap)", Call(**P64, softcap=CAP_MAX)),
    ("fwd(local,softcap)", "bwd(local,softcap)", Call(**P64, window=WIN, softcap=CAP_MAX)),
    ("fwd(varlen,softcap)", "bwd(varlen,softcap)", Call(h=4, hkv=2, lengths=LENGTHS, softcap=CAP_MAX)),
    ("fwd(local,varlen,softcap)", "bwd(local,varlen,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, window=WIN, softcap=CAP_MAX)),
    ("fwd(varlen,seqused,softcap)", "bwd(varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, softcap=CAP_MAX)),
    ("fwd(local,varlen,seqused,softcap)", "bwd(local,varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, window=WIN, softcap=CAP_MAX)),
    ("fwd(causal,softcap)", "bwd(causal,softcap)", Call(**P64, causal=True, softcap=CAP_MAX)),
    ("fwd(causal,varlen,softcap)", "bwd(causal,varlen,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, causal=True, softcap=CAP_MAX)),
    ("fwd(causal,local,varlen,softcap)", "bwd(causal,local,varlen,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, causal=True, window=WIN, softcap=CAP_MAX)),
    ("fwd(causal,varlen,seqused,softcap)", "bwd(causal,varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, causal=True, softcap=CAP_MAX)),
    ("fwd(causal,local,varlen,seqused,softcap)", "bwd(causal,local,varlen,seqused,softcap)",
     Call(h=4, hkv=2, lengths=LENGTHS, seqused=USED, causal=True, window=WIN, softcap=CAP_MAX)),
    ("fwd-gluon(d128,softcap)", "bwd-gluon(d128,softcap,dq-kernel,persistent)",
     Call(**P128, softcap=CAP_MAX)),
    ("fwd-gluon(d128,causal,pairs,softcap)", "bwd-gluon(d128,causal,softcap,dq-kernel,persistent)",
     Call(**E128, causal=True, softcap=CAP_MAX)),
    ("fwd-gluon(d128,local,softcap,dynamic)", "bwd-gluon(d128,local,softcap,dq-kernel,persistent)",
     Call(**P128, window=WIN, softcap=CAP_MAX)),
    ("fwd-gluon(d128,causal,local,softcap,dynamic)",
     "bwd-gluon(d128,causal,local,softcap,dq-kernel,persistent)",
     Call(**P128, causal=True, window=WIN, softcap=CAP_MAX)),
    ("fwd-gluon(d64,local,softcap,dynamic)",
     "bwd-gluon(d64,local,softcap,dq-ordered,persistent,dynamic)",
     Call(**N64, window=WIN, softcap=CAP_MAX)),
    ("fwd-gluon(d64,causal,softcap)", "bwd-gluon(d64,causal,softcap,dq-ordered,persistent,dynamic)",
     Call(b=2, nq=2176, nk=2176, h=4, hkv=2, causal=True, softcap=CAP_MAX)),
    ("fwd-gluon(d64,causal,pairs,softcap)", "bwd-gluon(d64,causal,softcap,dq-ordered,persistent,dynamic)",
     Call(nq=4096, nk=4096, h=6, hkv=2, causal=True, softcap=CAP_MAX)),
    ("fwd-gluon(d64,softcap)", "bwd-gluon(d64,softcap,dq-ordered,persistent,dynamic)",
     Call(**N64, softcap=CAP_MAX)),
    # v's head dim other than q's (the portable kernels' BLOCK_DV): d128 would take the Gluon
    # kernels, which cannot run it; MLA's 192 / 128, causal; decoding; packed.
    ("fwd", "bwd", Call(**P128, dv=64)),
    ("fwd(causal)", "bwd(causal)", Call(**MLA, causal=True)),
    ("fwd-split(causal)", "bwd(causal)", Call(**{**DEC, "d": 128}, dv=64, causal=True)),
    ("fwd(varlen)", "bwd(varlen)", Call(h=4, hkv=2, lengths=LENGTHS, dv=128)),
]  # fmt: skip
CASE_IDS = [f"{f}+{b}" + (f"-dv{c.dv}" if c.dv else "") for f, b, c in FAMILY_CASES]


def probe_families(call: Call, target: Target | None = H100) -> tuple[str, str]:
    """(forward, backward) family of `call` on CUDA tensors as `target` runs it (None: this
    machine's GPU), from fake tensors."""
    with FakeTensorMode():
        q, k, v, _ = (torch.empty(t.shape, dtype=call.dtype, device="cuda")
                      for t in call.inputs("cpu"))  # fmt: skip
        varlen, nq, nk = None, call.nq, call.nk
        if call.lengths is not None:
            nq, nk = (max(1, *(n[i] for n in call.lengths)) for i in (0, 1))
            cu = torch.empty(len(call.lengths) + 1, dtype=torch.int32, device="cuda")
            used = None
            if call.seqused is not None:
                used = torch.empty(len(call.lengths), dtype=torch.int32, device="cuda")
            varlen = Varlen(cu, cu, nq, nk, used)
        window = window_for(call.window, call.causal, nq, nk)
        fwd, bwd = families.probe_call(q, k, v, call.causal, call.softcap, window, varlen,
                                       call.deterministic, target)  # fmt: skip
    return families.family(fwd), families.family(bwd)


def _sweep():
    """Every call of the chooser's grid: head dims (two sizes of the Gluon kernels and a padded
    one), half and full precision, causal, a window's left (short or long: one split of a long
    cache or several; past the d64 and the d128 fused-dq backwards' persistent walks) or right
    edge / softcap / packing (with seqused_k too) in every combination, decoding (a long and a
    short cache) to long rows (block counts odd and even), deterministic or not, GQA or not."""
    lengths = {1: (1, 4096), 0: (1, 200), 128: (128, 128), 2176: (2176, 2176), 4096: (4096, 4096),
               8192: (8192, 8192), 8448: (8448, 8448)}  # fmt: skip
    for d, dtype, causal, window, softcap, packed, n, det, (b, h, hkv) in itertools.product(
        (64, 80, 128), (torch.bfloat16, torch.float32), (False, True),
        ((-1, -1), (256, -1), (1000, -1), LONG_WIN, LONG_WIN128, (-1, 64)),
        (0.0, 30.0, CAP_MAX), (False, True), lengths, (True, False), ((2, 4, 2), (1, 2, 2)),
    ):  # fmt: skip
        if causal and window[1] >= 0:
            continue  # (causal means right = 0)
        nq, nk = lengths[n]
        if packed:
            seqs = tuple((nq, nk) for _ in range(b))
            for used in (None, (nk // 2,) * b) if det else (None,):
                yield Call(h=h, hkv=hkv, d=d, causal=causal, window=window, softcap=softcap,
                           deterministic=det, lengths=seqs, seqused=used, dtype=dtype)  # fmt: skip
        else:
            yield Call(b=b, nq=nq, nk=nk, h=h, hkv=hkv, d=d, causal=causal, window=window,
                       softcap=softcap, deterministic=det, dtype=dtype)  # fmt: skip


def test_every_family_has_a_case():
    covered = {f for fwd, bwd, _ in FAMILY_CASES for f in (fwd, bwd)}
    found: dict[str, Call] = {}
    for call in _sweep():
        for fam in probe_families(call):
            found.setdefault(fam, call)
    missing = {fam: str(call) for fam, call in found.items() if fam not in covered}
    assert not missing, f"kernel families without a case in FAMILY_CASES: {missing}"
    unreached = covered - set(found)
    assert not unreached, f"FAMILY_CASES lists families the sweep never reaches: {unreached}"


@pytest.mark.parametrize("fwd, bwd, call", FAMILY_CASES, ids=CASE_IDS)
def test_cases_take_their_family(fwd, bwd, call):
    assert probe_families(call) == (fwd, bwd)


@pytest.mark.parametrize(
    "fwd, bwd, call",
    [c for c in FAMILY_CASES if c[2].lengths is None],
    ids=[i for i, c in zip(CASE_IDS, FAMILY_CASES) if c[2].lengths is None],
)
def test_explain_names_the_families(fwd, bwd, call):
    """`explain` (the public view of the choice) agrees with the probes, from fake tensors, as
    on an H100: the families, and the configs with why each was chosen."""
    with FakeTensorMode():
        q, k, v, _ = (torch.empty(t.shape, dtype=call.dtype, device="cuda")
                      for t in call.inputs("cpu"))  # fmt: skip
        e = explain(q, k, v, call.causal, window_size=call.window, softcap=call.softcap,
                    deterministic=call.deterministic, target=H100)  # fmt: skip
        window = window_for(call.window, call.causal, call.nq, call.nk)
        probes = families.probe_call(q, k, v, call.causal, call.softcap, window, None,
                                     call.deterministic, H100)  # fmt: skip
    assert (e.forward, e.backward) == (fwd, bwd)
    assert (e.forward_config, e.backward_config) == tuple(p.config for p in probes)
    assert e.forward_config.why and e.backward_config.why
    text = str(e)
    assert text.startswith(f"forward: {e.forward_config}\n  why: {e.forward_config.why}\n")
    assert f"\nbackward: {e.backward_config}\n  why: {e.backward_config.why}\n" in text
    assert f"  family: {fwd}\n" in text and f"  family: {bwd}\n" in text
    assert len(e.forward_launches) >= 1 and len(e.backward_launches) >= 2


LEADERBOARD_FAMILIES = {
    True: ("fwd-gluon(d64,causal,pairs)", "bwd-gluon(d64,causal,dq-ordered)"),
    False: ("fwd-gluon(d64)", "bwd-gluon(d64,dq-ordered,persistent,dynamic)"),
}


def _leaderboard(causal: bool) -> Call:
    return Call(b=16, nq=16384, nk=16384, h=1, hkv=1, d=64, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_leaderboard_families(causal):
    """The leaderboard shape (the course harness, README) takes the Gluon kernels both ways."""
    assert probe_families(_leaderboard(causal)) == LEADERBOARD_FAMILIES[causal]


def _sm90_gpu(device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _graphed(call: Call, q, k, v, do):
    """(o, dq, dk, dv) of the call captured in a CUDA graph, replayed on new inputs copied into
    the captured ones; checked against eager calls on the same inputs (bitwise)."""
    static = [t.clone() for t in (q, k, v, do)]
    cu = None if call.lengths is None else call.cu_seqlens(q.device)  # (no copy in a capture)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for _ in range(2):
            fwd_bwd(call, *static, cu=cu)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(call, *static, cu=cu)
    fresh = call.inputs(q.device, seed=5)
    with torch.no_grad():
        for t, new in zip(static, fresh):
            t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = fwd_bwd(call, *fresh, cu=cu)
    for name, a, b in zip(("o", "dq", "dk", "dv"), captured, eager):
        # (dq summed in any order may differ in its last bits from run to run)
        if call.deterministic or name != "dq":
            assert torch.equal(a, b), f"graph replay {name} differs from the eager call"
    with torch.no_grad():
        for t, new in zip(static, (q, k, v, do)):
            t.copy_(new)
    graph.replay()
    return [t.clone() for t in captured]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "compile", "graph"])
@pytest.mark.parametrize("fwd, bwd, call", FAMILY_CASES, ids=CASE_IDS)
def test_gpu_family(fwd, bwd, call, mode, device):
    """The case takes its families on this GPU, and its outputs and gradients meet the rule in
    each mode."""
    if not _sm90_gpu(device):
        pytest.skip("the families are sm_90's")
    assert probe_families(call, target=None) == (fwd, bwd)
    q, k, v, do = call.inputs(device)
    if mode == "eager":
        got = fwd_bwd(call, q, k, v, do)
    elif mode == "compile":
        torch._dynamo.reset()
        compiled = torch.compile(call.forward, fullgraph=True, backend="inductor")
        cu = None if call.lengths is None else call.cu_seqlens(device)
        got = fwd_bwd(call, q, k, v, do, fn=compiled, cu=cu)
    else:
        got = _graphed(call, q, k, v, do)
    check_call(call, got, q, k, v, do)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gpu_flash_attention_function_compiles_on_gluon_shapes(is_causal, device):
    """The leaderboard's interface through torch.compile(fullgraph=True) at a shape that takes
    the Gluon kernels: the same values as the eager call, bitwise (the same kernels run)."""
    if not _sm90_gpu(device):
        pytest.skip("the Gluon kernels are sm_90's")
    call = _leaderboard(is_causal)
    q, k, v, do = (t.squeeze(2) for t in call.inputs(device))
    assert probe_families(call, target=None) == LEADERBOARD_FAMILIES[is_causal]

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        return (o.detach(), *torch.autograd.grad(o, leaves, do))

    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: FlashAttentionFunction.apply(a, b, c, is_causal),
                             fullgraph=True)  # fmt: skip
    eager = run(lambda a, b, c: FlashAttentionFunction.apply(a, b, c, is_causal))
    for name, a, b in zip(("o", "dq", "dk", "dv"), run(compiled), eager):
        assert torch.equal(a, b), f"compiled {name} differs from eager"
