"""Who a webhook may call: global unicast addresses only, however an address is written."""

import ipaddress

import jsonschema_rs
import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import strategies as st

from controlplane import webhooks

REFUSED = [
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254, the metadata service
    "64:ff9b::7f00:1",  # NAT64 of loopback
    "64:ff9b:1::a9fe:a9fe",  # local-use NAT64: whatever the operator maps it to
    "2002:a9fe:a9fe::",  # 6to4 of the metadata service
    "2002:a00:1::1",  # 6to4 of 10.0.0.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "::ffff:169.254.169.254",  # IPv4-mapped
    "::169.254.169.254",  # IPv4-compatible
    "192.0.0.8",  # IETF protocol assignments, the whole /24
    "192.0.0.9",
    "192.0.0.170",
    "224.0.0.1",  # multicast
    "239.255.255.250",
    "ff02::1",
    "ff0e::1",
    "fec0::1",  # site-local
]
ACCEPTED = ["8.8.8.8", "2606:4700::1111", "64:ff9b::808:808", "2002:808:808::1"]


def url_for(address: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"https://{host}/hook"


@pytest.mark.parametrize("address", REFUSED)
def test_addresses_that_are_not_global_unicast_are_refused(address, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(webhooks.RefusedAddress, match="private address"):
        webhooks.check_destination(url_for(address))


@pytest.mark.parametrize("address", ACCEPTED)
def test_global_unicast_addresses_are_called(address, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = False
    assert webhooks.check_destination(url_for(address)) == address


def _refused(address) -> bool:
    with override_settings(WEBHOOK_ALLOW_PRIVATE=False):
        try:
            webhooks.check_destination(url_for(str(address)))
        except webhooks.RefusedAddress:
            return True
    return False


def embeddings(v4: ipaddress.IPv4Address, suffix: int) -> list[ipaddress.IPv6Address]:
    """The IPv6 addresses that carry v4: NAT64, 6to4 (any host part), mapped, compatible."""
    bits = int(v4)
    return [
        ipaddress.IPv6Address((0x0064FF9B << 96) | bits),
        ipaddress.IPv6Address((0x2002 << 112) | (bits << 80) | suffix),
        ipaddress.IPv6Address((0xFFFF << 32) | bits),
        ipaddress.IPv6Address(bits),
    ]


@given(v4=st.ip_addresses(v=4), suffix=st.integers(0, 2**80 - 1))
def test_an_ipv4_address_is_refused_however_it_is_written(v4, suffix):
    refused = _refused(v4)
    for v6 in embeddings(v4, suffix):
        assert _refused(v6) == refused, v6


@given(address=st.ip_addresses(network="224.0.0.0/4") | st.ip_addresses(network="ff00::/8"))
def test_multicast_is_refused(address):
    assert _refused(address)


@given(address=st.ip_addresses(network="192.0.0.0/24"))
def test_the_ietf_protocol_assignments_are_refused(address):
    assert _refused(address)


URI = jsonschema_rs.validator_for({"type": "string", "format": "uri"}, validate_formats=True)
PIECE = st.text(st.sampled_from("aZ09-._~!$&'()*+,;=:@/?#[]% é\x00\x7f\\\"<>{}|^`"), max_size=8)


@given(
    scheme=st.sampled_from(["https", "http", "ftp", "HTTPS", ""]),
    userinfo=st.one_of(st.just(""), PIECE.map(lambda text: text + "@")),
    host=st.sampled_from(["hooks.example", "8.8.8.8", "[2606:4700::1111]", "exämple.com", ""]),
    port=st.sampled_from(["", ":443", ":99999", ":x"]),
    rest=PIECE,
)
def test_every_url_a_webhook_accepts_is_a_uri(scheme, userinfo, host, port, rest):
    url = f"{scheme}://{userinfo}{host}{port}/{rest}"
    if webhooks.url_problem(url) is None:
        assert URI.is_valid(url), url


def test_redacted_urls_hide_credentials_and_the_query():
    assert webhooks.redacted_url("https://u:p@h.example:8443/a/b?t=1#f") == (
        "https://***@h.example:8443/a/b?***#***"
    )
    assert webhooks.redacted_url("https://h.example/a") == "https://h.example/a"
