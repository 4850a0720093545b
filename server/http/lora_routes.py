"""LoRA adapter routes, SGLang's: ``POST /load_lora_adapter`` (``{"lora_name", "lora_path"}``:
serve the PEFT adapter directory at ``lora_path`` as ``lora_name``) and ``POST
/unload_lora_adapter`` (``{"lora_name"}``). Both answer ``{"success": true,
"loaded_adapters": {name: path}}``; refused: 400 with the reason (LoRA off, the name taken,
every slot in use, an adapter that does not fit the base model), 404 for an unknown name, 409
for an adapter with requests queued or running. Adapters load between scheduler steps, so
requests in flight keep running. Requests pick an adapter by ``model`` on the OpenAI routes and
``lora_path`` on ``/generate`` (:func:`server.http.admission.lora_of_model`); ``GET
/v1/models`` lists them.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from server import protocol as P
from server.http.body import body_of
from server.http.errors import ApiError
from server.http.responses import manager_of
from server.http.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter()


async def _answer(request: Request, msg: P.LoadLoraReq | P.UnloadLoraReq) -> dict:
    manager = manager_of(request)
    reply = await manager.ask(msg, P.LoraReply, timeout=120.0)
    manager.loras = dict(reply.loras)
    if not reply.ok:
        raise ApiError(reply.status, reply.message, param="lora_name", type="not_found_error"
                       if reply.status == 404 else "invalid_request_error")
    return {"success": True, "loaded_adapters": reply.loras}


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoadLoraAdapterRequest = Depends(
        body_of(LoadLoraAdapterRequest))) -> dict:
    """Serve a PEFT LoRA adapter (see the module docstring)."""
    return await _answer(request, P.LoadLoraReq(body.lora_name, body.lora_path))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: UnloadLoraAdapterRequest = Depends(
        body_of(UnloadLoraAdapterRequest))) -> dict:
    """Stop serving a LoRA adapter (see the module docstring)."""
    return await _answer(request, P.UnloadLoraReq(body.lora_name))
