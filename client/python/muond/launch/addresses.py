"""Host names and addresses as the launcher accepts them: a host name, an
IPv4 or an IPv6 address (with or without brackets), and host:port."""
from __future__ import annotations

import ipaddress
import re

from muond.launch.errors import LaunchError


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return False


_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})"
                        r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")


def check_host(text: str, source: str) -> str:
    """A host name, an IPv4 or an IPv6 address (with or without brackets),
    returned without brackets (host_port adds them)."""
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if bare != text or ":" in bare:
        try:
            return str(ipaddress.IPv6Address(bare))
        except ValueError:
            raise LaunchError(f"{source} {text!r} is not an IPv6 address") from None
    if is_ip(bare) or _HOST_NAME.fullmatch(bare):
        return bare
    raise LaunchError(f"{source} {text!r} is not a host name, an IPv4 address or an IPv6 "
                      "address ([::1] or ::1)")


def host_port(host: str, port: int) -> str:
    """host:port, an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
