"""Images downloaded over http(s): one HTTP session per request's images, with a byte
cap (checked against Content-Length first, then counted as the body arrives), one
time limit over the whole download (redirects included), and the address policy
(address.py) on the first URL and on every redirect, which is followed by hand so
each hop is checked before it is fetched."""

import asyncio
from types import TracebackType

import aiohttp
from yarl import URL

from shared.multimodal.address import AddressRefused, CheckedResolver, check_literal
from shared.multimodal.errors import FetchFailed, FetchTimeout, ImageTooLarge, RefusedAddress, UnsupportedURL
from shared.runtime.settings import ImageSettings

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 1 << 16


class Fetcher:
    """Downloads of one request's images (``async with Fetcher(settings) as fetcher``)."""

    def __init__(self, settings: ImageSettings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "Fetcher":
        connector = aiohttp.TCPConnector(
            resolver=CheckedResolver(self.settings.fetch_private),
            use_dns_cache=False,  # every connection's addresses pass the resolver's check
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # trust_env=False: an HTTP proxy from the environment would connect for us,
            # to addresses the resolver never sees.
            trust_env=False,
            # The cap counts bytes as sent: a gzip body inflating past it is not read
            # as it inflates (nor is it an image: the decoder refuses it).
            auto_decompress=False,
            headers={"Accept-Encoding": "identity", "User-Agent": "infermesh-balancer"},
        )
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, param: str) -> bytes:
        """The body of url (after at most images.max_redirects redirects), at most images.max_bytes."""
        limit = self.settings.fetch_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._follow(url, param)
        except TimeoutError:
            raise FetchTimeout(param, f"{url} was not downloaded within {limit:g} s (images.fetch_timeout_s)") from None

    async def _follow(self, url: str, param: str) -> bytes:
        assert self._session is not None, "Fetcher is used as an async context manager"
        target = _parse(url, param)
        for hop in range(self.settings.max_redirects + 1):
            what = f"the redirect to {target}" if hop else str(target)
            try:
                assert target.host is not None  # _parse and _next_hop refuse URLs without one
                check_literal(target.host, self.settings.fetch_private)
                async with self._session.get(target, allow_redirects=False) as response:
                    if response.status in _REDIRECTS:
                        target = _next_hop(target, response, param)
                        continue
                    if response.status != 200:
                        raise FetchFailed(param, f"{what} answered {response.status} {response.reason or ''}".rstrip())
                    return await self._read(response, what, param)
            except AddressRefused as exc:
                raise RefusedAddress(
                    param, f"{what}: {exc}; images are fetched from public addresses only (images.fetch_private)"
                ) from None
            except aiohttp.ClientError as exc:
                raise FetchFailed(param, f"{what} could not be fetched: {exc}") from None
        raise FetchFailed(param, f"{url} redirected more than {self.settings.max_redirects} times "
                          "(images.max_redirects)")

    async def _read(self, response: aiohttp.ClientResponse, what: str, param: str) -> bytes:
        limit = self.settings.max_bytes
        declared = response.content_length
        if declared is not None and declared > limit:
            raise ImageTooLarge(param, f"{what} is {declared} bytes, more than the {limit} allowed (images.max_bytes)")
        data = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
            data += chunk
            if len(data) > limit:  # a server that sends more than it declared, or declared nothing
                raise ImageTooLarge(param, f"{what} sent more than the {limit} bytes allowed (images.max_bytes); "
                                    "the download was cut off")
        return bytes(data)


def _parse(url: str, param: str) -> URL:
    try:
        target = URL(url)
    except (ValueError, TypeError) as exc:
        raise UnsupportedURL(param, f"not a valid URL ({exc})") from None
    if target.scheme not in ("http", "https") or not target.host:
        raise UnsupportedURL(param, "an image URL is a base64 data: URL or an http(s) URL with a host")
    return target


def _next_hop(target: URL, response: aiohttp.ClientResponse, param: str) -> URL:
    location = response.headers.get("Location")
    if not location:
        raise FetchFailed(param, f"{target} answered {response.status} without a Location")
    try:
        following = target.join(URL(location))
    except (ValueError, TypeError) as exc:
        raise FetchFailed(param, f"{target} redirected to an invalid URL ({exc})") from None
    if following.scheme not in ("http", "https") or not following.host:
        raise FetchFailed(param, f"{target} redirected to {following}, which is not an http(s) URL")
    return following
