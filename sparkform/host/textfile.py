"""Metrics for node_exporter's textfile collector, in Prometheus' text format (written by
sparkform-guard and sparkform-record on the host)."""

import os


def label_value(value):
    """A label value as Prometheus' text format writes it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric_family(name, kind, help_text, samples):
    """One metric family in Prometheus' text format: HELP, TYPE and a line per (labels, value) sample."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        pairs = ",".join(f'{key}="{label_value(label)}"' for key, label in sorted(labels.items()))
        selector = "{" + pairs + "}" if pairs else ""
        lines.append(f"{name}{selector} {float(value)!r}")
    return "\n".join(lines) + "\n"


def write_textfile(path, text):
    """Replace `path` whole (mode 0644): a new file beside it, then a rename, so the collector
    never reads half a file. Only inside a folder that is the writer's (root's) alone, opened
    without following a link: the folder's parent may belong to another user (Debian's
    /var/lib/prometheus is prometheus'), who could otherwise point root's write elsewhere.
    OSError when it is not."""
    folder, name = os.path.split(path)
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        info = os.fstat(folder_fd)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise PermissionError(
                f"{folder} is not the writer's alone (owner uid {info.st_uid}, mode "
                f"{info.st_mode & 0o7777:o}): no metrics written into it"
            )
        temp = f".{name}.{os.getpid()}.tmp"  # not *.prom: the collector skips it
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=folder_fd)
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(text)
        os.replace(temp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    finally:
        os.close(folder_fd)
