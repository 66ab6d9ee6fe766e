"""What a compiled program runs, read from its optimized HLO text (``compiled.as_text()``).

The inventory lists every GEMM with its operand and result dtypes (GPU: the cuBLASLt / cuBLAS /
cuDNN custom calls and any ``dot`` left to a fusion; TPU: ``convolution``, which is how the MXU's
matmuls appear), the conditionals with the GEMMs of each branch, the loops with their trip
counts, the collectives with the bytes of their largest buffer, and the flash-attention kernels
(cuDNN's fused attention, Pallas splash attention) with the FLOPs their shapes imply. Counts are
of instructions in the program; ``executions`` multiplies each by the trip counts of the loops
around it.

Example:
  >>> hlo = '''HloModule m
  ... ENTRY %main (a: s8[4,8], b: s8[8,2]) -> s32[4,2] {
  ...   %a = s8[4,8]{1,0} parameter(0)
  ...   %b = s8[8,2]{1,0} parameter(1)
  ...   ROOT %gemm = (s32[4,2]{1,0}, s8[64]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/dot_general"}
  ... }'''
  >>> [(g.kind, g.lhs, g.rhs, g.result) for g in parse(hlo).gemms]
  [('cublaslt', 's8', 's8', 's32')]
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

# custom-call target -> GEMM kind
GEMM_TARGETS = {
    '__cublas$lt$matmul$f8': 'cublaslt_fp8',
    '__cublas$lt$matmul': 'cublaslt',
    '__cublas$gemm': 'cublas',
    '__cudnn$blockScaledDot': 'cudnn_block_scaled',
}
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute',
               'ragged-all-to-all', 'collective-broadcast')
_DTYPE_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 's32': 4,
                'u32': 4, 's64': 8, 'u64': 8, 'f16': 2, 'bf16': 2, 'f32': 4, 'f64': 8,
                'c64': 8, 'c128': 16}
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$')
_CALLEES = re.compile(
    r'\b(calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_INSTRUCTION_START = re.compile(r'\s*(?:ROOT\s+)?%[\w.\-]+\s*=')
# cuDNN fused attention: __cudnn$fmhaSoftmax, ...ScaleBiasSoftmax, ...Dropout, ...F8, and their
# ...Backward... twins.
_CUDNN_FMHA = re.compile(r'^__cudnn\$fmha\w*$')
# A Pallas splash kernel's name (splash_attention_kernel.get_kernel_name), as the custom call's
# op_name or instruction name carries it.
_SPLASH = re.compile(r'splash_(mha|mqa)_(fwd|dq|dkv)')
# The JAX op name of a gnmr_jax Transformer projection's matmul (forward, or its transposes in
# the backward pass): '.../layers/attn/q/...' or, routed, '.../layers/mlp/up/cond/branch_0_fun/...'
PROJECTION_OP = re.compile(r'/layers/(?:attn|mlp)/(q|k|v|o|gate|up|down)/')


def dtype_bytes(dtype: str) -> float:
  """Bytes per element (fp8 / e8m0: 1, fp4: 0.5)."""
  if dtype.startswith('f8'):
    return 1
  if dtype.startswith('f4'):
    return 0.5
  return _DTYPE_BYTES.get(dtype, 4)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, shape) of every array in an HLO type (an array or a tuple)."""
  return [(d, tuple(int(x) for x in s.split(',') if x))
          for d, s in _ARRAY.findall(type_text) if d in _DTYPE_BYTES or d[:2] in ('f8', 'f4')]


def nbytes(type_text: str) -> int:
  """Bytes of the largest array in an HLO type."""
  return int(max((math.prod(s) * dtype_bytes(d) for d, s in arrays(type_text)), default=0))


@dataclasses.dataclass
class Instruction:
  name: str
  computation: str
  type: str        # result type text
  opcode: str
  operands: list   # operand instruction names
  attributes: str  # everything after the operand list
  raw_operands: str = ''  # the text between the opcode's parentheses


@dataclasses.dataclass
class Gemm:
  """One GEMM of the program.

  Attributes:
    kind: 'cublaslt_fp8', 'cublaslt', 'cublas', 'cudnn_block_scaled' (GPU custom calls),
      'convolution' (TPU MXU), or 'dot' (a dot XLA kept as such, e.g. inside a fusion).
    lhs, rhs, result: dtypes ('f8e4m3fn', 's8', 'bf16', 's32', ...).
    result_shape: the (first) result's shape.
    op_name: the JAX op it came from (metadata), e.g. '.../layers/mlp/up/dot_general';
      'transpose(' in it marks a backward leg.
    computation: the HLO computation holding it.
    branches: ((conditional, branch index), ...) of the conditional branches around it,
      outermost first; () outside any. Index 0 is the false branch of a boolean conditional
      (a routed unit's low-cost path: nothing recovered), 1 the true one.
    executions: how many times one step runs it (loop trip counts multiplied; every branch
      counted as if taken).
  """
  kind: str
  lhs: str
  rhs: str
  result: str
  result_shape: tuple
  op_name: str
  computation: str
  branches: tuple = ()
  executions: int = 1
  flops: int = 0   # of one execution: 2 * result elements * contraction size
  instruction: str = ''  # the HLO instruction's name

  @property
  def total_flops(self) -> int:
    return self.flops * self.executions

  @property
  def backward(self) -> bool:
    return 'transpose(' in self.op_name

  @property
  def projection(self) -> str | None:
    """The Transformer projection ('q', ..., 'down') this GEMM computes, or None.

    XLA merges GEMMs that share an operand (q, k and v of one input; gate and up); the merged
    GEMM carries one of their names, so count FLOPs rather than names per projection.
    """
    match = PROJECTION_OP.search(self.op_name)
    return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class FlashKernel:
  """A flash-attention kernel the inventory recognises, and the GEMMs one launch runs.

  Per (query, key) pair a launch runs `qk_gemms` GEMMs of contraction length D (the query /
  key head dimension: S = QK^T, dQ = dS K, dK = dS^T Q) and `v_gemms` of length Dv (the value
  head dimension: O = P V, dV = P^T dO, dP = dO V^T), so

    flops = 2 * B * H * S * T * (qk_gemms * D + v_gemms * Dv)   (halved when causal)

  with H the query heads (grouped-query attention reads fewer K / V heads, every query head
  still multiplies), S the query and T the key length.

  Attributes:
    kernel: the implementation ('cudnn', 'splash'): selects the efficiency
      (device_specs.ATTENTION_EFFICIENCY).
    phase: 'fwd', 'bwd' (a whole backward in one launch), 'dq' or 'dkv' (splash's split one).
    qk_gemms, v_gemms: as above.
    doc: the GEMMs, named.
  """
  kernel: str
  phase: str
  qk_gemms: int
  v_gemms: int
  doc: str

  @property
  def backward(self) -> bool:
    return self.phase != 'fwd'


# (kernel, phase) -> its GEMMs; splash's from splash_attention_kernel.py (flash_attention_kernel,
# _flash_attention_dq_kernel, _flash_attention_dkv_kernel).
FLASH_KERNELS = {(k.kernel, k.phase): k for k in (
    FlashKernel('cudnn', 'fwd', 1, 1, 'S = QK^T, O = PV'),
    FlashKernel('cudnn', 'bwd', 3, 2, 'S = QK^T (recomputed), dV = P^T dO, dP = dO V^T, '
                'dQ = dS K, dK = dS^T Q'),
    FlashKernel('splash', 'fwd', 1, 1, 'S = QK^T, O = PV'),
    FlashKernel('splash', 'dq', 2, 1, 'S = QK^T (recomputed), dP = dO V^T, dQ = dS K'),
    FlashKernel('splash', 'dkv', 2, 2, 'S = QK^T (recomputed), dV = P^T dO, dP = dO V^T, '
                'dK = dS^T Q'),
    FlashKernel('splash', 'bwd', 3, 2, 'the dkv kernel with dQ fused in '
                '(BlockSizes.use_fused_bwd_kernel)'),
)}


@dataclasses.dataclass
class Attention:
  """One flash-attention kernel of the program.

  Attributes:
    kind: its FLASH_KERNELS entry.
    batch_heads: B * H (query heads).
    seq_q, seq_kv: S and T.
    head_dim, head_dim_v: D (query / key) and Dv (value).
    causal: whether the kernel skips the keys after each query (FLOPs halved): cuDNN's
      backend_config mask_type; a splash kernel given its mask function's q_sequence operand
      (CausalMask and its kin; gnmr_jax builds only CausalMask).
    flops: of one execution.
    executions, branches, instruction, computation, op_name: as Gemm's.
  """
  kind: FlashKernel
  batch_heads: int
  seq_q: int
  seq_kv: int
  head_dim: int
  head_dim_v: int
  causal: bool
  flops: int
  instruction: str
  computation: str
  op_name: str = ''
  branches: tuple = ()
  executions: int = 1

  @property
  def total_flops(self) -> int:
    return self.flops * self.executions


def _flash_kind(instruction: Instruction) -> FlashKernel | None:
  if instruction.opcode != 'custom-call':
    return None
  target = _TARGET.search(instruction.attributes)
  target = target.group(1) if target else ''
  if _CUDNN_FMHA.match(target):
    return FLASH_KERNELS['cudnn', 'bwd' if 'Backward' in target else 'fwd']
  if target == 'tpu_custom_call':
    op_name = _OP_NAME.search(instruction.attributes)
    match = _SPLASH.search(op_name.group(1) if op_name else '') or _SPLASH.search(
        instruction.name)
    if match:
      return FLASH_KERNELS['splash', match.group(2)]
  return None


def _attention(instruction: Instruction, kind: FlashKernel, operands: list) -> Attention | None:
  """The shapes and FLOPs of a flash-attention call; None when its operands cannot be read.

  Args:
    operands: (dtype, shape) of each operand.
  """
  attributes = instruction.attributes
  floats = [shape for dtype, shape in operands
            if dtype in ('bf16', 'f16', 'f32') or dtype.startswith('f8')]
  if len(floats) < 3 or min(len(s) for s in floats[:3]) < 2:
    return None
  q, k, v = floats[:3]
  if kind.kernel == 'cudnn':
    # q, k, v come first ([B, S, H, D]: jax.nn.dot_product_attention's layout); the scores'
    # shape [B, H, S, T] is in the backend_config.
    head_dim, head_dim_v = q[-1], v[-1]
    scores = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]',
                       attributes)
    dims = [int(d) for d in re.findall(r'\d+', scores.group(1))] if scores else []
    if len(dims) == 4:
      batch_heads, seq_q, seq_kv = dims[0] * dims[1], dims[2], dims[3]
    else:
      batch_heads, seq_q, seq_kv = q[0] * q[2], q[1], k[1]
    mask = re.search(r'"mask_type":\s*"(\w+)"', attributes)
    causal = bool(mask) and 'CAUSAL' in mask.group(1)
  else:
    # q [..., H, S, D], k and v [..., K, T, D] ([T, D] for MQA), a vmap's batch in front;
    # QKVLayout.SEQ_MINOR (2) swaps the last two.
    def last_two(shape, name):
      seq_minor = re.search(rf'{name}_layout\\?":\s*2\b', attributes)
      return (shape[-1], shape[-2]) if seq_minor else (shape[-2], shape[-1])
    seq_q, head_dim = last_two(q, 'q')
    seq_kv, _ = last_two(k, 'k')
    _, head_dim_v = last_two(v, 'v')
    batch_heads = math.prod(q) // (seq_q * head_dim)
    if kind.phase == 'dkv' and any(len(shape) > len(q) for _, shape in arrays(instruction.type)):
      kind = FLASH_KERNELS['splash', 'bwd']  # dQ fused in: its result has a block axis more
    # A computable mask (CausalMask, LocalMask, ChunkedCausalMask) reads the q_sequence iota,
    # [S, 128] or [8, T]; a full mask has none.
    causal = any(dtype == 's32' and len(shape) == 2 and (
        shape in ((seq_q, 128), (8, seq_kv))) for dtype, shape in operands)
  flops = 2 * batch_heads * seq_q * seq_kv * (kind.qk_gemms * head_dim
                                              + kind.v_gemms * head_dim_v)
  if causal:
    share = 0.5
    blocks = _splash_blocks(attributes, kind.phase) if kind.kernel == 'splash' else None
    if blocks:  # splash skips whole blocks above the diagonal, and computes the rest whole
      share = causal_block_share(seq_q, seq_kv, *blocks)
    flops = int(flops * share)
  op_name = _OP_NAME.search(attributes)
  return Attention(kind, batch_heads, seq_q, seq_kv, head_dim, head_dim_v, causal,
                   flops, instruction.name, instruction.computation,
                   op_name.group(1) if op_name else '')


# The (query, key) block sizes of each splash kernel's grid, as its xprof_metadata names them.
_SPLASH_BLOCK_FIELDS = {'fwd': ('block_q', 'block_kv'), 'dq': ('block_q_dq', 'block_kv_dq'),
                        'dkv': ('block_q_dkv', 'block_kv_dkv'),
                        'bwd': ('block_q_dkv', 'block_kv_dkv')}


def _splash_blocks(attributes: str, phase: str) -> tuple[int, int] | None:
  sizes = []
  for field in _SPLASH_BLOCK_FIELDS[phase]:
    found = re.search(rf'{field}\\?":\s*(\d+)', attributes)
    if not found:
      return None
    sizes.append(int(found.group(1)))
  return sizes[0], sizes[1]


def causal_block_share(seq_q: int, seq_kv: int, block_q: int, block_kv: int) -> float:
  """Share of a [seq_q, seq_kv] causal grid a block-sparse kernel computes: every block
  holding a (query, key <= query) pair, whole.

  Example:
    >>> causal_block_share(256, 256, 256, 256), causal_block_share(256, 256, 128, 128)
    (1.0, 0.75)
    >>> round(causal_block_share(8192, 8192, 512, 512), 4)
    0.5312
  """
  rows, cols = -(-seq_q // block_q), -(-seq_kv // block_kv)
  computed = sum(min(cols, ((r + 1) * block_q - 1) // block_kv + 1) for r in range(rows))
  return computed / (rows * cols)


@dataclasses.dataclass
class Inventory:
  """The parsed program: instructions by name and what ran where."""
  instructions: dict
  computations: dict            # name -> [instruction names]
  entry: str
  gemms: list
  conditionals: dict            # conditional name -> [branch computations]
  loops: dict                   # while name -> trip count (None: unknown)
  collectives: list             # (opcode, bytes of the largest buffer, executions)
  attention: list = dataclasses.field(default_factory=list)  # Attention, one per kernel call

  def gemm_counts(self) -> dict:
    """'<kind> <lhs> x <rhs> -> <result>' -> number of GEMM instructions."""
    return dict(collections.Counter(
        f'{g.kind} {g.lhs} x {g.rhs} -> {g.result}' for g in self.gemms))

  def taken(self, branch: int | None = 0) -> list[Gemm]:
    """The GEMMs a step runs when every conditional takes `branch` (0: a routed step with
    nothing recovered, 1: everything recovered); None: every GEMM of the program."""
    return [g for g in self.gemms
            if branch is None or all(index == branch for _, index in g.branches)]

  def flops_by_kind(self, branch: int | None = 0, projection: bool | None = None) -> dict:
    """'<kind> <lhs> x <rhs> -> <result>' -> FLOPs of one step (executions counted).

    Args:
      branch: as in `taken`.
      projection: True counts only the Transformer projections' GEMMs, False only the others
        (attention, output head), None all.
    """
    out = collections.Counter()
    for g in self.taken(branch):
      if projection is None or (g.projection is not None) == projection:
        out[f'{g.kind} {g.lhs} x {g.rhs} -> {g.result}'] += g.total_flops
    return dict(out)

  def attention_flops(self, branch: int | None = 0, forward_only: bool = False) -> int:
    """FLOPs of one step's flash-attention kernels (executions counted; branch as in `taken`).

    Args:
      forward_only: only the forward kernels (3x them: the attention's model FLOPs of a
        training step, the backward's recomputation of QK^T left out).
    """
    return sum(a.total_flops for a in self.attention
               if (branch is None or all(index == branch for _, index in a.branches))
               and not (forward_only and a.kind.backward))

  def collective_summary(self) -> dict:
    """opcode -> {'count', 'bytes' (sum of largest buffers, times executions)}."""
    out = {}
    for opcode, size, executions in self.collectives:
      entry = out.setdefault(opcode, {'count': 0, 'bytes': 0})
      entry['count'] += 1
      entry['bytes'] += size * executions
    return out

  def branch_gemms(self, conditional: str) -> list[list[Gemm]]:
    """The GEMMs under each branch of `conditional` (nested conditionals included)."""
    return [[g for g in self.gemms if (conditional, index) in g.branches]
            for index in range(len(self.conditionals[conditional]))]


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] in '([{':
      depth += 1
    elif text[i] in ')]}':
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _instruction(line: str, computation: str) -> Instruction | None:
  match = re.match(r'\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*', line)
  if not match:
    return None
  pos = match.end()
  if line[pos] == '(':
    end = _balanced(line, pos)
  else:
    end = line.index(' ', pos)
  type_text = line[pos:end]
  rest = line[end:].lstrip()
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  operands = re.findall(r'%([\w.\-]+)', rest[op.end():close - 1])
  return Instruction(match.group(1), computation, type_text, op.group(1), operands,
                     rest[close:], rest[op.end():close - 1])


def _callees(instruction: Instruction) -> list[str]:
  names = [m.group(2) for m in _CALLEES.finditer(instruction.attributes)]
  for group in _BRANCHES.findall(instruction.attributes):
    names += re.findall(r'%([\w.\-]+)', group)
  return names


def _branches(instruction: Instruction) -> list[str]:
  group = _BRANCHES.search(instruction.attributes)
  if group:
    return re.findall(r'%([\w.\-]+)', group.group(1))
  false = re.search(r'false_computation=%([\w.\-]+)', instruction.attributes)
  true = re.search(r'true_computation=%([\w.\-]+)', instruction.attributes)
  return [m.group(1) for m in (false, true) if m]  # indexed by the predicate's value


def _walk(instructions: dict, computations: dict, entry: str, trip, callees):
  """The call graph from `entry` as a device runs it, the one walk of the module: yields
  (name, instruction, computation, executions, branch, in_loop) for each instruction of every
  computation reached, before what it calls. A while loop's body and condition run
  `trip(name, instruction, condition)` times (None: once) and are in a loop; a conditional's
  branches extend `branch` (the path of (conditional, index)); any other instruction's callees
  are what `callees(instruction)` names.
  """
  def walk(computation, times, branch, in_loop, depth):
    if depth > 64:
      raise ValueError('HLO call graph deeper than 64 levels')
    for name in computations.get(computation, ()):
      instruction = instructions[name]
      yield name, instruction, computation, times, branch, in_loop
      if instruction.opcode == 'while':
        body = re.search(r'\bbody=%([\w.\-]+)', instruction.attributes).group(1)
        cond = re.search(r'\bcondition=%([\w.\-]+)', instruction.attributes).group(1)
        inner = times * (trip(name, instruction, cond) or 1)
        yield from walk(body, inner, branch, True, depth + 1)
        yield from walk(cond, inner, branch, True, depth + 1)
      elif instruction.opcode == 'conditional':
        for index, callee in enumerate(_branches(instruction)):
          yield from walk(callee, times, branch + ((name, index),), in_loop, depth + 1)
      else:
        for callee in callees(instruction):
          yield from walk(callee, times, branch, in_loop, depth + 1)

  return walk(entry, 1, (), False, 0)


def _gemm_kind(instruction: Instruction) -> str | None:
  if instruction.opcode == 'custom-call':
    target = _TARGET.search(instruction.attributes)
    return GEMM_TARGETS.get(target.group(1)) if target else None
  if instruction.opcode in ('convolution', 'dot'):
    return instruction.opcode
  return None


def _window(attributes: str) -> dict:
  """A convolution's window fields per spatial dimension: pad (lo, hi), stride, lhs_dilate."""
  found = re.search(r'window=\{([^}]*)\}', attributes)
  out = {}
  for field, value in re.findall(r'(\w+)=([\d_x]+)', found.group(1) if found else ''):
    if field == 'pad':
      out['pad'] = [tuple(int(v) for v in part.split('_')) for part in value.split('x')]
    elif field in ('stride', 'lhs_dilate'):
      out[field] = [int(v) for v in value.split('x')]
  return out


def window_taps(lhs_size: int, window: int, pad=(0, 0), stride: int = 1,
                lhs_dilate: int = 1) -> float:
  """Real lhs elements a window dimension's window meets per output position, on average.

  The lhs (dilated: `lhs_dilate - 1` holes between elements) is padded by `pad` and the
  window slides by `stride`; holes and padding hold zeros, which the MXU never multiplies
  (the window is how XLA:TPU writes a batched matmul's batch dimension: one real element).

  Example:
    >>> window_taps(5, 3)                          # a plain valid convolution: the window
    3.0
    >>> window_taps(1, 32, pad=(31, 31))           # a padded size-1 dimension: one element
    1.0
    >>> window_taps(4, 4, stride=3, lhs_dilate=4)  # a dilated one: one element
    1.0
  """
  extent = (lhs_size - 1) * lhs_dilate + 1
  outputs = (extent + pad[0] + pad[1] - window) // stride + 1
  if outputs <= 0:
    return 0.0
  taps = 0
  for o in range(outputs):  # the window of output o covers dilated positions [first, last]
    first = max(0, o * stride - pad[0])
    last = min(extent - 1, o * stride - pad[0] + window - 1)
    if last >= first:  # the real elements among them: multiples of the dilation
      taps += last // lhs_dilate - -(-first // lhs_dilate) + 1
  return taps / outputs


def _contraction_size(instruction: Instruction, operand_shapes: list) -> float:
  """Elements summed per output element (K), or 0 when the operands are unknown."""
  if not operand_shapes or operand_shapes[0] is None:
    return 0
  attributes = instruction.attributes
  if instruction.opcode == 'convolution':
    # dim_labels=<lhs>_<rhs>-><out>: every rhs dimension but the output feature 'o' is summed;
    # a window dimension sums the real lhs elements its window meets (window_taps: a TPU
    # batched matmul is a convolution whose batch dimensions are windows over a dilated or
    # padded lhs, one real element each).
    labels = re.search(r'dim_labels=(\w+)_(\w+)->', attributes)
    lhs = operand_shapes[0]
    rhs = operand_shapes[1] if len(operand_shapes) > 1 else None
    if not labels or rhs is None or len(labels.group(2)) != len(rhs):
      return 0
    window = _window(attributes)
    size = 1.0
    for d, label in zip(rhs, labels.group(2)):
      if label.isdigit():
        spatial = int(label)
        lhs_size = (lhs[labels.group(1).index(label)]
                    if label in labels.group(1) and len(lhs) == len(labels.group(1)) else d)
        size *= window_taps(lhs_size, d, **{key: values[spatial] for key, values
                                            in window.items() if spatial < len(values)})
      elif label != 'o':
        size *= d
    return size
  if instruction.opcode == 'dot':
    dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', attributes)
  elif _gemm_kind(instruction) == 'cudnn_block_scaled':
    return operand_shapes[0][-1]  # [B, M, K] x [B, N, K] (jax.nn.scaled_matmul's layout)
  else:
    dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
  if not dims:
    return 0
  lhs = operand_shapes[0]
  indices = [int(d) for d in re.findall(r'\d+', dims.group(1))]
  return math.prod(lhs[i] for i in indices if i < len(lhs))


def _logical_lines(hlo_text: str) -> list[str]:
  """The text's lines, an instruction printed over several joined into one.

  A TPU custom call's frontend_attributes hold a string with line breaks (a Pallas kernel's
  xprof_metadata), so its op_name and backend_config follow on later lines; an instruction
  whose brackets are still open takes the next line unless that one starts an instruction or
  closes a computation.
  """
  out, open_brackets = [], 0
  for line in hlo_text.splitlines():
    starts = _INSTRUCTION_START.match(line) is not None
    if open_brackets > 0 and not starts and line.strip() != '}':
      out[-1] += ' ' + line.strip()
    else:
      out.append(line)
      open_brackets = 0
      if not starts:
        continue
    open_brackets += sum(map(line.count, '([{')) - sum(map(line.count, ')]}'))
  return out


def parse(hlo_text: str) -> Inventory:
  """The inventory of an optimized HLO module's text.

  The last few texts' inventories are kept (a report, its step-time projection and a test
  read the same program): the same text returns the same Inventory, to be read, not changed.
  """
  return _parse_cached(hlo_text)


@functools.lru_cache(maxsize=4)
def _parse_cached(hlo_text: str) -> Inventory:
  instructions, computations, entry, current = {}, {}, None, None
  for line in _logical_lines(hlo_text):
    header = _COMPUTATION.match(line)
    if header and not line.startswith(' '):
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if current is None:
      continue
    instruction = _instruction(line, current)
    if instruction is not None:
      instructions[instruction.name] = instruction
      computations[current].append(instruction.name)
  if entry is None:
    raise ValueError('not an HLO module text: no ENTRY computation')

  def _counted_trip(condition):
    """N of a condition `i < N` with N a constant (jax's scans count from 0 by 1), or None.

    TPU programs carry no known_trip_count; their loop conditions read this way.
    """
    for name in computations.get(condition, ()):
      compare = instructions[name]
      if compare.opcode != 'compare' or 'direction=LT' not in compare.attributes:
        continue
      for operand in compare.operands[1:]:
        constant = instructions.get(operand)
        if constant is not None and constant.opcode == 'constant':
          value = re.match(r'\s*(\d+)\s*$', constant.raw_operands)
          if value:
            return int(value.group(1))
    return None

  gemms, conditionals, loops, collectives, attention = [], {}, {}, [], []
  executions = collections.Counter()
  branch_of = {}  # branch: the path of (conditional, index) to an instruction

  def trip(name, instruction, condition):
    known = _TRIP.search(instruction.attributes)
    loops[name] = int(known.group(1)) if known else _counted_trip(condition)
    return loops[name]

  for name, instruction, _, times, branch, _ in _walk(instructions, computations, entry, trip,
                                                      _callees):
    executions[name] += times
    branch_of.setdefault(name, branch)
    if instruction.opcode == 'conditional':
      conditionals[name] = _branches(instruction)
  for name, count in executions.items():
    instruction = instructions[name]
    kind = _gemm_kind(instruction)
    if kind is not None:
      result_dtype, result_shape = (arrays(instruction.type) or [('?', ())])[0]
      operands = [(arrays(instructions[o].type) or [('?', None)])[0]
                  if o in instructions else ('?', None) for o in instruction.operands[:2]]
      operands += [('?', None)] * (2 - len(operands))
      op_name = _OP_NAME.search(instruction.attributes)
      flops = round(2 * math.prod(result_shape) * _contraction_size(
          instruction, [shape for _, shape in operands]))
      gemms.append(Gemm(kind, operands[0][0], operands[1][0], result_dtype, result_shape,
                        op_name.group(1) if op_name else '', instruction.computation,
                        branch_of[name], count, flops, name))
    flash = _flash_kind(instruction)
    if flash is not None:
      call = _attention(instruction, flash, [(arrays(instructions[o].type) or [('?', ())])[0]
                                             if o in instructions else ('?', ())
                                             for o in instruction.operands])
      if call is not None:
        attention.append(dataclasses.replace(call, branches=branch_of[name], executions=count))
    base = instruction.opcode.removesuffix('-start')
    if base in COLLECTIVES and not instruction.opcode.endswith('-done'):
      size = max([nbytes(instruction.type)]
                 + [nbytes(instructions[o].type) for o in instruction.operands
                    if o in instructions])
      collectives.append((base, size, count))
  return Inventory(instructions, computations, entry, gemms, conditionals, loops, collectives,
                   attention)


# --- Kernels: what a device launches, for gnmr_jax.aot.step_time ------------------------------
# Opcodes that launch nothing: they name, bundle or alias buffers, or are control flow (whose
# computations are walked instead).
_NO_KERNEL = frozenset((
    'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while', 'conditional',
    'call', 'after-all', 'partition-id', 'replica-id', 'opt-barrier', 'add-dependency',
    'copy-done', 'send-done', 'recv-done', 'async-done', 'async-update', 'iota'))
_SLICING = frozenset(('dynamic-slice', 'slice', 'gather'))
# Custom calls that only reinterpret buffers (TPU: the pieces of an asynchronous slice, side by
# side in memory, read as one array).
_NO_KERNEL_TARGETS = frozenset(('ConcatBitcast',))


@dataclasses.dataclass
class Kernel:
  """One kernel launch site of the program (a fusion, a library call, a collective, a copy).

  Attributes:
    name, opcode, computation: the HLO instruction and where it sits.
    executions: launches per step (loop trip counts multiplied).
    branches: ((conditional, branch index), ...) around it, outermost first (as Gemm.branches).
    in_loop: whether a while loop encloses it.
    bytes_read, bytes_written: memory traffic of one launch: operands and results, where a
      fused parameter only sliced (dynamic-slice, slice, gather) counts its slices and an
      in-place dynamic-update-slice counts its update.
    flops: GEMM FLOPs of one launch (0 for a kernel without a GEMM); a flash-attention
      kernel's (Attention.flops).
    gemm: '<lhs> x <rhs> -> <result>' dtypes of its (largest) GEMM, or ''.
    dtypes: every dtype of its operands, results and (for a fusion) fused instructions.
    op_name: the JAX op it came from (metadata).
    attention: '<kernel> <phase>' of a flash-attention kernel ('cudnn fwd', 'splash dkv'; see
      FLASH_KERNELS), else ''.
    seq_kv: a flash-attention kernel's key length T (its efficiency depends on it), else 0.
  """
  name: str
  opcode: str
  computation: str
  executions: int
  branches: tuple
  in_loop: bool
  bytes_read: float
  bytes_written: float
  flops: int = 0
  gemm: str = ''
  dtypes: frozenset = frozenset()
  op_name: str = ''
  attention: str = ''
  seq_kv: int = 0


def _array_bytes(type_text: str) -> float:
  """Bytes of every array in an HLO type (a tuple's elements summed)."""
  return float(sum(math.prod(s) * dtype_bytes(d) for d, s in arrays(type_text)))


def _fused_body(inventory: Inventory, fusion: Instruction):
  """(params by index, users by operand name, root) of the computation `fusion` calls."""
  callee = re.search(r'\bcalls=%([\w.\-]+)', fusion.attributes)
  body = inventory.computations.get(callee.group(1), []) if callee else []
  users = collections.defaultdict(list)
  params, root = {}, None
  for name in body:
    instruction = inventory.instructions[name]
    for operand in instruction.operands:
      users[operand].append(instruction)
    if instruction.opcode == 'parameter':
      params[int(instruction.raw_operands.strip() or 0)] = instruction
    root = instruction  # the ROOT is printed last
  return params, users, root


def _reads(inventory: Inventory, fusion: Instruction, index: int, full: float,
           depth: int = 0) -> float:
  """Bytes a launch of `fusion` reads of its operand `index` (full size `full`): its slices
  when only sliced (bitcasts and nested fusions followed), nothing when only updated in place."""
  params, users, _ = _fused_body(inventory, fusion)
  if index not in params or depth > 8:
    return full

  def through(name):
    total = 0.0
    for user in users.get(name, ()):
      if user.opcode == 'bitcast':
        total += through(user.name)
      elif user.opcode in _SLICING and user.operands[0] == name:
        total += _array_bytes(user.type)
      elif user.opcode == 'dynamic-update-slice' and user.operands[0] == name:
        continue  # updated in place: only the update is touched (counted as written)
      elif user.opcode == 'fusion':  # nested (TPU): what the inner fusion reads of it
        total += sum(_reads(inventory, user, i, full, depth + 1)
                     for i, operand in enumerate(user.operands) if operand == name)
      else:
        return full
    return total

  return min(through(params[index].name), full)


def _fused_traffic(inventory: Inventory, fusion: Instruction) -> tuple[float, float]:
  """(bytes read, bytes written) of one launch of `fusion`."""
  instructions = inventory.instructions
  _, _, root = _fused_body(inventory, fusion)
  read = 0.0
  for index, operand in enumerate(fusion.operands):
    full = _array_bytes(instructions[operand].type) if operand in instructions else 0.0
    read += _reads(inventory, fusion, index, full)
  outputs = [root] if root is not None else []
  if root is not None and root.opcode == 'tuple':
    outputs = [instructions[o] for o in root.operands if o in instructions]
  written = 0.0
  for output in outputs:
    while output.opcode == 'bitcast' and output.operands and output.operands[0] in instructions:
      output = instructions[output.operands[0]]
    if output.opcode == 'dynamic-update-slice' and len(output.operands) > 1:
      written += _array_bytes(instructions[output.operands[1]].type)
    else:
      written += _array_bytes(output.type)
  if not outputs:
    written = _array_bytes(fusion.type)
  return read, written


def _all_dtypes(inventory: Inventory, instruction: Instruction) -> set:
  types = [instruction.type] + [inventory.instructions[o].type for o in instruction.operands
                                if o in inventory.instructions]
  callee = re.search(r'\bcalls=%([\w.\-]+)', instruction.attributes)
  if instruction.opcode == 'fusion' and callee:
    types += [inventory.instructions[n].type
              for n in inventory.computations.get(callee.group(1), [])]
  return {d for text in types for d, _ in arrays(text)}


def kernels(inventory: Inventory) -> list[Kernel]:
  """Every kernel launch site of the program, walked as a device runs it.

  The entry computation, each while loop's body and condition (executions times its trip
  count), each conditional's branches (every branch listed, `branches` telling which) and
  called computations; a fusion or a custom call is one kernel (its GEMMs' FLOPs summed in), a
  conditional one site of its own (opcode 'conditional', no bytes: choosing the branch); a
  flash-attention custom call carries its FLOPs (inventory.attention) and names itself in
  `attention`.
  Instructions that launch nothing (parameters, tuples, bitcasts, control flow) are left out.

  Example:
    >>> hlo = '''HloModule m
    ... ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
    ...   %a = bf16[64,32]{1,0} parameter(0)
    ...   %b = bf16[32,16]{1,0} parameter(1)
    ...   ROOT %d = bf16[64,16]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}
    ... }'''
    >>> [(k.opcode, k.flops, k.gemm, k.bytes_read, k.bytes_written) for k in kernels(parse(hlo))]
    [('custom-call', 65536, 'bf16 x bf16 -> bf16', 5120.0, 2048.0)]
  """
  instructions = inventory.instructions
  attention_calls = {a.instruction: a for a in inventory.attention}
  gemms_in = collections.defaultdict(list)  # computation -> its GEMMs
  for gemm in inventory.gemms:
    gemms_in[gemm.computation].append(gemm)

  def fused_gemms(computation, depth=0):
    found = list(gemms_in.get(computation, ()))
    if depth < 8:
      for name in inventory.computations.get(computation, ()):
        for callee in _callees(instructions[name]):
          found += fused_gemms(callee, depth + 1)
    return found

  out = []
  # A fusion or custom call is one kernel: only calls are walked into (control flow always is).
  sites = _walk(instructions, inventory.computations, inventory.entry,
                lambda name, instruction, condition: inventory.loops.get(name),
                lambda instruction: (_callees(instruction)
                                     if instruction.opcode in ('call', 'async-start') else ()))
  for name, instruction, computation, times, branch, in_loop in sites:
    opcode = instruction.opcode
    if opcode == 'conditional':
      # the predicate's read and the branch launch: a kernel site of its own
      out.append(Kernel(name, opcode, computation, times, branch, in_loop, 0.0, 0.0))
      continue
    if opcode in _NO_KERNEL or opcode == 'async-start' or opcode.endswith('-done'):
      continue
    target = _TARGET.search(instruction.attributes) if opcode == 'custom-call' else None
    if target and target.group(1) in _NO_KERNEL_TARGETS:
      continue
    if opcode == 'fusion':
      read, written = _fused_traffic(inventory, instruction)
      callee = re.search(r'\bcalls=%([\w.\-]+)', instruction.attributes)
      inner_gemms = fused_gemms(callee.group(1)) if callee else []
    else:
      read = sum(_array_bytes(instructions[o].type) for o in instruction.operands
                 if o in instructions)
      written = _array_bytes(instruction.type)
      inner_gemms = [g for g in gemms_in.get(computation, ()) if g.instruction == name]
      if inner_gemms and arrays(instruction.type):
        # a library GEMM: its first result (a tuple adds the workspace, never read back)
        dtype, shape = arrays(instruction.type)[0]
        written = float(math.prod(shape) * dtype_bytes(dtype))
    largest = max(inner_gemms, key=lambda g: g.flops, default=None)
    op_name = _OP_NAME.search(instruction.attributes)
    call = attention_calls.get(name)
    out.append(Kernel(
        name, opcode, computation, times, branch, in_loop, read, written,
        call.flops if call else sum(g.flops for g in inner_gemms),
        f'{largest.lhs} x {largest.rhs} -> {largest.result}' if largest else '',
        frozenset(_all_dtypes(inventory, instruction)), op_name.group(1) if op_name else '',
        f'{call.kind.kernel} {call.kind.phase}' if call else '', call.seq_kv if call else 0))

  return out
