"""Dollars at a provider's list prices: the price table (S3's and R2's, dated, replaceable by a
JSON file) and the bill of requests by kind, bytes out and in, and storage.

Egress is what clients read from the bucket (a volunteer's downloads, the scheduler's reads when
it runs outside the provider's region); uploads are ingress, free at both providers.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Mapping

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, ValidationError, computed_field


class Provider(BaseModel):
    """One provider's list prices, keyed by ``IOStats``' request kinds (get, put, head, list,
    delete, and ``other`` for any kind not named)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    per_million: dict[str, NonNegativeFloat] = Field(description="dollars per million requests, by kind")
    egress_per_gb: NonNegativeFloat = Field(description="bytes clients read from the bucket over the internet")
    ingress_per_gb: NonNegativeFloat = 0.0
    storage_per_gb_month: NonNegativeFloat
    notes: str = ""

    def request_price(self, kind: str) -> float:
        """Dollars per million requests of ``kind``."""
        price = self.per_million.get(kind, self.per_million.get("other"))
        if price is None:
            raise ValueError(f"price table: {self.name} has no price for {kind!r} requests (nor 'other')")
        return price


class PriceTable(BaseModel):
    model_config = ConfigDict(extra="forbid")

    date: datetime.date = Field(description="when these prices were read")
    source: str
    gigabyte: int = Field(2**30, gt=0, description="bytes in a billed GB (AWS bills binary gigabytes)")
    providers: dict[str, Provider] = Field(min_length=1)


PRICES = PriceTable(
    date=datetime.date(2026, 12, 1),
    source="list prices on the providers' pricing pages: https://aws.amazon.com/s3/pricing/ and "
           "https://developers.cloudflare.com/r2/pricing/; free tiers not counted",
    providers={
        "s3": Provider(
            name="AWS S3 Standard (us-east-1)",
            per_million={"put": 5.0, "post": 5.0, "list": 5.0, "get": 0.4, "head": 0.4, "delete": 0.0,
                         "other": 0.4},
            egress_per_gb=0.09, storage_per_gb_month=0.023,
            notes="PUT, COPY, POST, LIST $0.005 per 1,000; GET, HEAD and all other $0.0004 per 1,000; DELETE "
                  "free; data transfer out to the internet $0.09/GB (first 10 TB a month), in free; storage "
                  "$0.023/GB-month (first 50 TB). Reads from EC2 in the same region pay no transfer."),
        "r2": Provider(
            name="Cloudflare R2 Standard",
            per_million={"put": 4.5, "post": 4.5, "list": 4.5, "get": 0.36, "head": 0.36, "delete": 0.0,
                         "other": 4.5},
            egress_per_gb=0.0, storage_per_gb_month=0.015,
            notes="Class A (PutObject, ListObjects, CopyObject, multipart) $4.50 per million; Class B "
                  "(GetObject, HeadObject) $0.36 per million; DeleteObject free; egress free; storage "
                  "$0.015/GB-month. The monthly free tier (10 GB-month, 1M Class A, 10M Class B) is not counted."),
    },
)


def load_prices(path: str | Path) -> PriceTable:
    """A price table from a JSON file shaped like ``PRICES`` (``PRICES.model_dump_json()``); it
    replaces the built-in one. A bad file raises ValueError saying what is wrong."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"prices {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"prices {path}: not a JSON file ({exc})") from None
    try:
        return PriceTable.model_validate(raw)
    except ValidationError as exc:
        wrong = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'table'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"prices {path}: {wrong}") from None


class Dollars(BaseModel):
    requests: dict[str, float] = Field(description="by request kind")
    egress: float = 0.0
    ingress: float = 0.0
    storage: float = 0.0

    @computed_field
    @property
    def total(self) -> float:
        return sum(self.requests.values()) + self.egress + self.ingress + self.storage


def bill(requests: Mapping[str, float], bytes_out: float, bytes_in: float, provider: str | Provider,
         prices: PriceTable = PRICES, gb_months: float = 0.0) -> Dollars:
    """Dollars at one provider for ``requests`` (by kind), ``bytes_out`` read from the bucket (its
    egress), ``bytes_in`` written to it, and ``gb_months`` of storage."""
    if isinstance(provider, str):
        if provider not in prices.providers:
            raise ValueError(f"price table has no provider {provider!r}; it has {', '.join(prices.providers)}")
        provider = prices.providers[provider]
    gb = prices.gigabyte
    return Dollars(requests={k: n * provider.request_price(k) / 1e6 for k, n in requests.items()},
                   egress=bytes_out / gb * provider.egress_per_gb, ingress=bytes_in / gb * provider.ingress_per_gb,
                   storage=gb_months * provider.storage_per_gb_month)

