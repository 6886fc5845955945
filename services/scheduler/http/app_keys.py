"""What the application carries for its handlers: the scheduler's front door, the body
schemas of this deployment, and the key and tenancy policy."""

from __future__ import annotations

from aiohttp import web

from services.scheduler.http.schemas import RequestSchemas
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.runtime.front_door import FrontDoor

FRONT_DOOR = web.AppKey("front_door", FrontDoor)
SCHEMAS = web.AppKey("schemas", RequestSchemas)
TENANCY = web.AppKey("tenancy", Tenancy)
