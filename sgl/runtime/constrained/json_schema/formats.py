"""`format` values we enforce, as anchored patterns over decoded text.

Each pattern is a subset of what the usual validators (python-jsonschema with its
format checkers, the Rust `jsonschema` crate) accept, so a generated value always
validates: dates check month lengths and leap years, times allow a leap second,
addresses check octet ranges. Unknown format names are annotations per the spec and
constrain nothing; known ones we cannot express raise in strict mode.
"""

from __future__ import annotations

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_OFFSET = r"(?:[Zz]|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_PARTIAL_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?"
TIME = rf"{_PARTIAL_TIME}{_OFFSET}"
DATE_TIME = rf"{DATE}[Tt]{_PARTIAL_TIME}{_OFFSET}"
UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"
IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = r"[0-9a-fA-F]{1,4}"
_LS32 = rf"(?:{_H16}:{_H16}|{IPV4})"
IPV6 = (
    r"(?:"
    rf"(?:{_H16}:){{6}}{_LS32}"
    rf"|::(?:{_H16}:){{5}}{_LS32}"
    rf"|(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}"
    rf"|(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}"
    rf"|(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}"
    rf"|(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}"
    rf"|(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}"
    rf"|(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}"
    rf"|(?:(?:{_H16}:){{0,6}}{_H16})?::"
    r")"
)
# Labels of letters/digits/hyphens, no edge hyphen; at most 4 labels of <= 62 keeps
# the whole name under the 253-character limit without counting it.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,60}[A-Za-z0-9])?"
HOSTNAME = rf"{_LABEL}(?:\.{_LABEL}){{0,3}}"
_EMAIL_LOCAL = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~\-]+)*"
_DOMAIN_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?"
EMAIL = rf"{_EMAIL_LOCAL}@{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})+"
_URI_CHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})"
_AUTH_CHAR = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
# RFC 3986 hier-part: "//" authority (empty in file:///x) then a path or query, an
# absolute path (urn:/x) or a rootless one (mailto:a@b); then an optional fragment.
URI = (
    rf"[A-Za-z][A-Za-z0-9+.\-]*:"
    rf"(?://(?:{_AUTH_CHAR}+(?:[/?]{_URI_CHAR}*)?|/{_URI_CHAR}*)"
    rf"|/(?:{_AUTH_CHAR}{_URI_CHAR}*)?"
    rf"|{_AUTH_CHAR}{_URI_CHAR}*)(?:#{_URI_CHAR}*)?"
)

FORMATS: dict[str, str] = {
    "date": DATE,
    "time": TIME,
    "date-time": DATE_TIME,
    "uuid": UUID,
    "ipv4": IPV4,
    "ipv6": IPV6,
    "hostname": HOSTNAME,
    "email": EMAIL,
    "uri": URI,
}

# Formats the JSON Schema spec (or common validators) define, that we do not enforce.
KNOWN_UNENFORCED = {
    "idn-email", "idn-hostname", "iri", "iri-reference", "uri-reference", "uri-template",
    "json-pointer", "relative-json-pointer", "regex", "duration",
}
