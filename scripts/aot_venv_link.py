"""Lets this interpreter's environment (.venv-aot) import the packages of another (.venv).

Writes <site-packages>/_gnmr_jax_cpu_env.pth with `site.addsitedir(<other site-packages>)`, so
the other environment's own .pth files (the editable gnmr_jax install) are processed too, after
this environment's packages (the AOT compilers).

  .venv-aot/bin/python scripts/aot_venv_link.py "$(.venv/bin/python -c 'import sysconfig;
      print(sysconfig.get_paths()["purelib"])')"
"""

import os
import sys
import sysconfig


def main(argv):
  if len(argv) != 2 or not os.path.isdir(argv[1]):
    print(f"usage: {argv[0]} <site-packages directory of the CPU environment>", file=sys.stderr)
    return 2
  target = os.path.join(sysconfig.get_paths()["purelib"], "_gnmr_jax_cpu_env.pth")
  with open(target, "w") as f:
    f.write(f"import site; site.addsitedir({os.path.abspath(argv[1])!r})\n")
  print(f"{target} -> {argv[1]}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
