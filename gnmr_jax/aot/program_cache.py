"""A cache of compiled programs' reports (optimized HLO text, memory analysis, compile seconds).

jax's persistent compilation cache cannot serve a compile-only executable (jax 0.10.2 cannot
deserialize one without a device client), so a deviceless compile of an unchanged step would
run XLA again every time. This cache keeps what the reports read instead, keyed like jax's own
cache: the lowered program's text, the compiler options, the target's description and the
versions of jax, jaxlib and the compilers. A hit is the program XLA would build again.

Entries are gzip'd JSON files named by the key's SHA-256 under the cache directory.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os


@dataclasses.dataclass
class Program:
  """What a report needs of a compiled step."""
  hlo_text: str
  memory: dict          # compile.memory_of
  compile_s: float      # seconds XLA took when it compiled it
  cached: bool = False  # read from the cache


def key(lowered_text: str, target_description: str, options: dict, versions: dict) -> str:
  digest = hashlib.sha256()
  for part in (lowered_text, target_description, json.dumps(options, sort_keys=True),
               json.dumps(versions, sort_keys=True)):
    digest.update(part.encode())
    digest.update(b'\0')
  return digest.hexdigest()


def load(cache_dir: str | None, entry_key: str) -> Program | None:
  if not cache_dir:
    return None
  path = os.path.join(cache_dir, entry_key + '.json.gz')
  try:
    with gzip.open(path, 'rt') as f:
      data = json.load(f)
    return Program(data['hlo_text'], data['memory'], data['compile_s'], cached=True)
  except (OSError, EOFError, ValueError, KeyError):  # absent, or a writer killed mid-entry
    return None


def store(cache_dir: str | None, entry_key: str, program: Program) -> None:
  if not cache_dir:
    return
  os.makedirs(cache_dir, exist_ok=True)
  path = os.path.join(cache_dir, entry_key + '.json.gz')
  with gzip.open(path + '.tmp', 'wt') as f:
    json.dump({'hlo_text': program.hlo_text, 'memory': program.memory,
               'compile_s': program.compile_s}, f)
  os.replace(path + '.tmp', path)  # readers never see half an entry
