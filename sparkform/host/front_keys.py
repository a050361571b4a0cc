"""The front's key file: the clients' keys as nginx reads them (written by the deploy), and the
first client's key read back (the guard's and the host's own requests go as that client).
Pure: shared by the deploy's rendering and the guard."""

import re

# A client's line in the front's key file (clients_snippet below; root's): only a key of the
# schema's shape and a client name of its shape are taken.
CLIENT_LINE = re.compile(
    r'^    "~\^Bearer ((?:[A-Za-z0-9_~/=-]|\\[.+]){16,1024})\$" "([a-z0-9][a-z0-9._-]{0,63})";$', re.M
)
SNIPPET_BYTES = 2**20
NO_CLIENT = "-"  # what the map gives a request with no client's key (and the access log shows)


def clients_snippet(clients):
    """The front's key file, included at nginx's http level: a map from the request's key (as a
    bearer token: $sparkform_bearer, which takes x-api-key too) to the client's name, NO_CLIENT
    for none. A regex each, as nginx's plain map entries match without regard to case: a key
    differs from another in case too. Each key went through the schema's shape check (no quote,
    backslash or $), so escaping its . and + makes it a literal."""
    lines = "".join(f'    "~^Bearer {escaped(key)}$" "{name}";\n' for name, key in clients.items())
    return (
        "# The front's clients (written by sparkform): key -> client name.\n"
        "map $sparkform_bearer $sparkform_client {\n"
        f'    default "{NO_CLIENT}";\n{lines}'
        "}\n"
    )


def escaped(key):
    return key.replace(".", "\\.").replace("+", "\\+")


def front_key(path):
    """The first client's key in the front's key file (the guard's own requests go as that
    client); None when there is none or the file is not of the deploy's making."""
    if not path:
        return None
    try:
        with open(path) as handle:
            match = CLIENT_LINE.search(handle.read(SNIPPET_BYTES))
    except OSError:
        return None
    return match[1].replace("\\", "") if match else None
