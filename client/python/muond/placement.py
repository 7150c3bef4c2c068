"""``muond.placement``: where each param of a torchrun trainer lives
(muond.torch.placement) and which daemon a rank talks to
(muond.torch.discovery), under the name they had before muond.torch became
a package."""
from muond.torch.discovery import *  # noqa: F401,F403
from muond.torch.discovery import Discovered, default_socket, discover, env_rank  # noqa: F401
from muond.torch.placement import *  # noqa: F401,F403
from muond.torch.placement import (ParamPlace, Options, Request, check_layout,  # noqa: F401
                                   chunk_rows, claims, domain_name, is_dtensor, mesh_roles,
                                   place_dtensor, place_params, replicas, settle, summary)
