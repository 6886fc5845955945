"""What the application carries for its handlers: the scheduler's front door, the body
schemas of this deployment, the key and tenancy policy, the chat template, and where its
tokenizer's files are (`/get_model_info`'s `tokenizer_path`)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from services.scheduler.http.schemas import RequestSchemas
from services.scheduler.http.tenancy import Tenancy
from services.scheduler.runtime.front_door import FrontDoor
from services.scheduler.text.chat_tokens import ChatEncoder

# the core's front door; in an edge worker, edge/remote_door.py's stand-in for the calls
# of the routes a worker serves
FRONT_DOOR = web.AppKey("front_door", FrontDoor)
SCHEMAS = web.AppKey("schemas", RequestSchemas)
TENANCY = web.AppKey("tenancy", Tenancy)
CHAT = web.AppKey("chat", ChatEncoder)
TOKENIZER_DIR = web.AppKey("tokenizer_dir", Path)
