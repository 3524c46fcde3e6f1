"""JAX's persistent compilation cache, on by default, so a requeued or resumed run skips XLA compilation.

The cache is keyed by the computation, the devices and the compiler flags, so one folder serves
every config and topology; entries are written by one process and read by all, and a corrupt or
unwritable cache costs a warning and a recompile, never the run.
"""

from __future__ import annotations

import logging
import os

OFF = "none"


def default_dir() -> str:
    """``$JAX_COMPILATION_CACHE_DIR``, else ``$JAXRAT_CACHE_DIR/xla``, else the user cache folder."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    root = os.environ.get("JAXRAT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxrat")
    return os.path.join(root, "xla")


def enable(directory: str = "") -> str | None:
    """Point JAX's compilation cache at ``directory`` ("" for :func:`default_dir`, "none" for off).

    Returns the folder in use, or None when off or when the folder cannot be created (a warning
    says why; training goes on without the cache).
    """
    import jax

    if directory.strip().lower() == OFF:
        # jax reads $JAX_COMPILATION_CACHE_DIR by itself at import: "none" has to switch that off too.
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    path = os.path.abspath(os.path.expanduser(directory or default_dir()))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        logging.warning("compilation cache off: cannot create %s (%s); set --config.train.compilation_cache_dir "
                        "to a writable folder, or to 'none'", path, e.strerror or e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Seconds of compilation worth a cache entry: the train and eval steps take seconds to minutes,
    # the many tiny jits of setup (shardings, init) are not worth the disk round trip.
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))
    logging.info("compilation cache: %s", path)
    return path
