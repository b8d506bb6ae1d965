"""`KdaMoeImageProcessor`: images -> packed, flattened patches for `KdaMoeVisionModel` (native resolution).

Per image: load (PIL image, numpy array, torch tensor, or a path / URL / base64 string) -> RGB -> check the size
(too small, too elongated or decompression-bomb sized images raise a `ValueError`) -> resize so that both sides
are multiples of `patch_size * merge_size`, keeping the aspect ratio and the native resolution as far as the patch
budget `max_patches` allows -> rescale to [0, 1] and normalise -> cut into `patch_size` patches, row-major.

Output (`BatchFeature`, torch tensors): `pixel_values` [total_patches, 3 * patch_size**2] (all images packed) and
`image_grid_thw` [num_images, 3] = (1, grid_h, grid_w). Image `i` becomes `grid_h * grid_w / merge_size**2` text
tokens. Resizing is torch's antialiased bicubic interpolation on tensors, the same operation as transformers'
torchvision backend, so the processor needs neither torchvision nor PIL for array inputs (PIL only to open files).
A PIL image at least `2 * REDUCING_GAP` times its target size per side is first shrunk inside PIL by an integer
factor (`Image.reduce`, a box filter), so no full-resolution array is ever made of it.
"""

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

from ..remote_code import write_remote_code

IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
# PIL's own decompression-bomb threshold (`PIL.Image.MAX_IMAGE_PIXELS`, about 89.5 megapixels).
MAX_IMAGE_PIXELS = 89_478_485
# A PIL image is box-reduced to no less than this many times its target size before the final bicubic resize; 2 is
# what PIL's `thumbnail` uses (a result indistinguishable from resizing the full image in most cases).
REDUCING_GAP = 2
# Modes `Image.reduce` accepts among those the processor reads; images of other modes are read at full resolution.
REDUCIBLE_MODES = ("RGB", "RGBA", "L", "LA")


def _is_pil_image(image) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(image, Image.Image)


def reduce_pil_image(image, height: int, width: int):
    """`image` shrunk by the largest integer factor that leaves it at least `REDUCING_GAP` times (height, width), or
    `image` itself when that factor is below 2. Keeps the memory of a huge image's preprocessing bounded by its
    target size: the box filter runs inside PIL, before any array is made."""
    factor = min(image.height // (REDUCING_GAP * height), image.width // (REDUCING_GAP * width))
    if factor < 2 or image.mode not in REDUCIBLE_MODES:
        return image
    return image.reduce(factor)


def flatten_images(images) -> list:
    """A flat list of images from one image, a list, or a list of lists (one list per sample / conversation)."""
    if isinstance(images, (list, tuple)):
        return [image for item in images for image in flatten_images(item)]
    return [images]


class KdaMoeImageProcessor(BaseImageProcessor):
    r"""
    Args:
        patch_size (`int`, defaults to 14): patch side in pixels (= `vision_config.patch_size`).
        merge_size (`int`, defaults to 2): patch-merger window (= `vision_config.spatial_merge_size`).
        max_patches (`int`, defaults to 4096): patch budget per image; larger images are downscaled to fit.
        min_image_size (`int`, defaults to 14): images with a side shorter than this many pixels are rejected.
        max_image_pixels (`int`, defaults to PIL's 89,478,485): larger images are rejected (decompression bombs).
        max_aspect_ratio (`float`, defaults to 200): longer side / shorter side above this is rejected.
        image_mean, image_std (`list[float]`): per-channel normalisation after rescaling to [0, 1].
        do_convert_rgb (`bool`): convert grayscale / RGBA / palette images to RGB (alpha is dropped).

    Integer arrays and tensors are read as 0..255, floating ones as already in [0, 1]. Arrays may be HW, HWC or CHW.
    """

    model_input_names = ["pixel_values", "image_grid_thw"]
    CALL_KWARGS = (
        "patch_size", "merge_size", "max_patches", "min_image_size", "max_image_pixels", "max_aspect_ratio",
        "image_mean", "image_std", "do_convert_rgb",
    )  # fmt: skip

    def __init__(
        self,
        patch_size: int = 14,
        merge_size: int = 2,
        max_patches: int = 4096,
        min_image_size: int = 14,
        max_image_pixels: int = MAX_IMAGE_PIXELS,
        max_aspect_ratio: float = 200.0,
        image_mean: list[float] | None = None,
        image_std: list[float] | None = None,
        do_convert_rgb: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.max_patches = max_patches
        self.min_image_size = min_image_size
        self.max_image_pixels = max_image_pixels
        self.max_aspect_ratio = max_aspect_ratio
        self.image_mean = list(image_mean if image_mean is not None else IMAGE_MEAN)
        self.image_std = list(image_std if image_std is not None else IMAGE_STD)
        self.do_convert_rgb = do_convert_rgb
        if max_patches < merge_size**2:
            raise ValueError(f"max_patches={max_patches} must be >= merge_size**2={merge_size**2} (one text token).")

    # ----- sizes

    def target_size(self, height: int, width: int, **overrides) -> tuple[int, int]:
        """(height, width) after resizing: multiples of `patch_size * merge_size`, aspect ratio kept, at most
        `max_patches` patches, at least one merged patch. Raises `ValueError` for unusable sizes."""
        settings = {key: overrides.get(key, getattr(self, key)) for key in self.CALL_KWARGS}
        factor = settings["patch_size"] * settings["merge_size"]
        if min(height, width) < settings["min_image_size"]:
            raise ValueError(
                f"The image is {width}x{height} pixels (width x height); both sides must be at least "
                f"min_image_size={settings['min_image_size']} pixels. Use a larger image (or lower min_image_size)."
            )
        if height * width > settings["max_image_pixels"]:
            raise ValueError(
                f"The image is {width}x{height} = {height * width} pixels, over max_image_pixels="
                f"{settings['max_image_pixels']} (a possible decompression bomb). Downscale it first, or raise "
                "max_image_pixels if you trust the source."
            )
        if max(height, width) / min(height, width) > settings["max_aspect_ratio"]:
            raise ValueError(
                f"The image is {width}x{height}: its aspect ratio exceeds max_aspect_ratio="
                f"{settings['max_aspect_ratio']}. Crop or pad it to a less elongated shape."
            )
        max_pixels = settings["max_patches"] * settings["patch_size"] ** 2
        new_h = max(factor, round(height / factor) * factor)
        new_w = max(factor, round(width / factor) * factor)
        if new_h * new_w > max_pixels:
            scale = math.sqrt(height * width / max_pixels)
            new_h = max(factor, math.floor(height / scale / factor) * factor)
            new_w = max(factor, math.floor(width / scale / factor) * factor)
        return new_h, new_w

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        """Patches of an image of this size (divide by `merge_size**2` for its number of text tokens)."""
        new_h, new_w = self.target_size(height, width, **(images_kwargs or {}))
        patch_size = (images_kwargs or {}).get("patch_size", self.patch_size)
        return (new_h // patch_size) * (new_w // patch_size)

    # ----- loading

    def to_tensor(self, image: Any, **overrides) -> tuple[torch.Tensor, tuple[int, int]]:
        """Any supported image -> (float32 tensor [3, h, w] in [0, 1], the (height, width) to resize it to).

        The size is checked before any conversion. A PIL image far larger than its target is reduced inside PIL
        first (`reduce_pil_image`), so (h, w) may be smaller than the image; the target follows the image's own size."""
        do_convert_rgb = overrides.get("do_convert_rgb", self.do_convert_rgb)
        if isinstance(image, str):
            from transformers.image_utils import load_image

            try:
                image = load_image(image)
            except Exception as error:  # unreadable path / URL / bytes: say what was wrong with the input
                raise ValueError(f"Could not load an image from the string {image[:80]!r}: {error}") from error
        target = None
        if _is_pil_image(image):
            target = self.target_size(image.height, image.width, **overrides)  # check before decoding a bomb
            if do_convert_rgb and image.mode != "RGB":
                image = image.convert("RGB")
            image = np.array(reduce_pil_image(image, *target))  # a writable copy
        if isinstance(image, np.ndarray):
            if image.dtype == object or not (np.issubdtype(image.dtype, np.number) or image.dtype == bool):
                raise ValueError(f"A numpy image must hold numbers, got dtype {image.dtype}.")
            image = torch.from_numpy(np.array(image, copy=not image.flags.writeable, order="C"))
        if not isinstance(image, torch.Tensor):
            raise ValueError(
                f"Expected an image (PIL.Image.Image, numpy array, torch tensor, or a path / URL string), got "
                f"{type(image).__name__}."
            )
        if image.ndim == 2:
            image = image[None]
        if image.ndim != 3:
            raise ValueError(f"An image array must be HW, HWC or CHW, got shape {tuple(image.shape)}.")
        if image.shape[0] not in (1, 3, 4) and image.shape[-1] in (1, 3, 4):
            image = image.permute(2, 0, 1)  # HWC -> CHW
        if image.shape[0] not in (1, 3, 4):
            raise ValueError(
                f"Could not find the channel axis of an image of shape {tuple(image.shape)}: expected 1, 3 or 4 "
                "channels first or last."
            )
        if target is None:
            target = self.target_size(image.shape[1], image.shape[2], **overrides)  # checks on a view, before any copy
        if image.dtype.is_floating_point:
            image = image.float()
        else:
            image = image.float() / 255.0
        if image.shape[0] == 4:
            image = image[:3]  # drop alpha
        if image.shape[0] == 1:
            if not do_convert_rgb:
                raise ValueError("A single-channel image needs do_convert_rgb=True (the vision tower reads RGB).")
            image = image.expand(3, -1, -1)
        return image, target

    # ----- processing

    def preprocess(self, images, return_tensors: str | None = "pt", **kwargs) -> BatchFeature:
        # keyword arguments meant for other processors (e.g. forwarded by a pipeline) are ignored
        kwargs = {key: value for key, value in kwargs.items() if key in self.CALL_KWARGS and value is not None}
        settings = {key: kwargs.get(key, getattr(self, key)) for key in self.CALL_KWARGS}
        images = flatten_images(images)
        if not images or any(image is None for image in images):
            raise ValueError("`images` must be one image or a (nested) list of images, with no None entries.")
        patch_size = settings["patch_size"]
        mean = torch.tensor(settings["image_mean"]).view(3, 1, 1)
        std = torch.tensor(settings["image_std"]).view(3, 1, 1)

        patches, grids = [], []
        for image in images:
            image, (new_h, new_w) = self.to_tensor(image, **kwargs)
            if (new_h, new_w) != tuple(image.shape[1:]):
                image = F.interpolate(image[None], size=(new_h, new_w), mode="bicubic", antialias=True)[0]
                image = image.clamp(0.0, 1.0)
            image = (image - mean) / std
            grid_h, grid_w = new_h // patch_size, new_w // patch_size
            # [3, gh * P, gw * P] -> [gh, gw, 3, P, P] -> [gh * gw, 3 * P * P]
            image = image.view(3, grid_h, patch_size, grid_w, patch_size).permute(1, 3, 0, 2, 4)
            patches.append(image.reshape(grid_h * grid_w, -1))
            grids.append([1, grid_h, grid_w])
        data = {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, images, return_tensors: str | None = "pt", **kwargs) -> BatchFeature:
        return self.preprocess(images, return_tensors=return_tensors, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        for key in ("_valid_processor_keys", "_valid_kwargs_names"):
            output.pop(key, None)
        return output

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`BaseImageProcessor.save_pretrained`, plus this module's source and an `auto_map` naming it, so
        `AutoImageProcessor.from_pretrained(folder, trust_remote_code=True)` loads it where kda_moe is not installed."""
        self.auto_map = write_remote_code(save_directory, {"AutoImageProcessor": KdaMoeImageProcessor})
        return super().save_pretrained(save_directory, *args, **kwargs)


__all__ = ["KdaMoeImageProcessor"]
