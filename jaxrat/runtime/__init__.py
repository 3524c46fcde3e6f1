"""What every command shares and no model or trainer concern owns: console and log handling
(:mod:`~jaxrat.runtime.console`), user-facing errors, whole-file writes, the compilation cache,
huge pages and platform hints."""
