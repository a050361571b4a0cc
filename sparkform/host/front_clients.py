"""Requests per client of the front, as metrics for node_exporter's textfile collector: counted by
sparkform-guard's daemon (monitoring on) from the front's access log, which names each request's
client and never its key."""

import os
import re
import stat
import time

from sparkform.host import GuardSettings
from sparkform.host.alerts import journal
from sparkform.host.textfile import metric_family, write_textfile

# One line of the front's access log (templates/nginx-front.conf.j2, log_format sparkform_clients):
# time, address, client ("-": no valid key), "METHOD path", status, bytes, seconds. nginx (www-data)
# writes the file: a line of any other shape is not counted.
ACCESS_LINE = re.compile(
    r'[0-9T:+.-]{10,40} [0-9a-fA-F.:]{2,45} ([a-z0-9][a-z0-9._-]{0,63}|-) "[A-Z]{1,16} [^"\s]{1,4096}" '
    r"([1-5])[0-9]{2} [0-9]{1,20} [0-9.]{1,20}"
)
READ_BYTES = 8 * 2**20  # the most one round reads: a burst beyond it is counted in the next rounds
LONGEST_LINE = 8192


class AccessLog:
    """The access log's new lines since the last call. It is followed from where it ends when first
    seen (the counts run from the guard's start); a new file at the path (logrotate) or one cut
    shorter is read from its start."""

    def __init__(self, path):
        self.path, self.inode, self.offset, self.rest = path, None, 0, b""

    def new_lines(self):
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"{self.path} is not a plain file")
            if self.inode is None:
                self.inode, self.offset = info.st_ino, info.st_size
            elif info.st_ino != self.inode or info.st_size < self.offset:
                self.inode, self.offset, self.rest = info.st_ino, 0, b""
            handle.seek(self.offset)
            data = handle.read(READ_BYTES)
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        if len(self.rest) > LONGEST_LINE:  # no line of the front's is that long: drop it
            self.rest = b""
        return [line.decode("utf-8", "replace") for line in lines]


def counted(lines, counts):
    """`counts` ((client, status class) -> requests) with `lines` added."""
    for line in lines:
        match = ACCESS_LINE.fullmatch(line)
        if match:
            key = (match[1], f"{match[2]}xx")
            counts[key] = counts.get(key, 0) + 1
    return counts


def client_metrics(counts):
    return metric_family(
        "sparkform_front_requests_total",
        "counter",
        "Requests the front answered since the guard started, by client (- for a request without a valid key) "
        "and status class.",
        [({"client": client, "code": code}, n) for (client, code), n in sorted(counts.items())],
    )


def clients_watch(config: GuardSettings):
    """Count the access log's new lines into the front's textfile every front_count_s; a failure
    (no log yet, a link at its path) is journaled once per kind, and the counts kept."""
    log, told = AccessLog(config["front_access_log"]), None
    counts: dict[tuple[str, str], int] = {}
    while True:
        try:
            write_textfile(config["front_textfile"], client_metrics(counted(log.new_lines(), counts)))
            told = None
        except OSError as err:
            if told is not type(err):
                journal(config, f"sparkform-guard: no per-client counts: {err}", 4)
                told = type(err)
        time.sleep(config["front_count_s"])
