"""Multimodal example: chat about a bundled (procedurally drawn) image with a small kda-moe model.

    python examples/multimodal.py [--steps 80] [--output-dir outputs/multimodal]

Builds a small vision + text model and the processor shipped with the package (tokenizer and chat template, no
download), teaches it for a few seconds to answer one question about the image, saves and reloads it through
`AutoModelForImageTextToText` / `AutoProcessor`, then asks the question with `apply_chat_template` + `generate` and
prints the reply. Runs on CPU in well under a minute; uses the GPU when one is present.
"""

import argparse
import time

import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText, AutoProcessor

import kda_moe  # noqa: F401  (registers the Auto classes)
from kda_moe import KdaMoeConfig, KdaMoeForConditionalGeneration, KdaMoeProcessor


def bundled_image() -> Image.Image:
    """A 96x64 picture: a red sun over a green hill under a blue sky."""
    image = Image.new("RGB", (96, 64), (110, 160, 235))
    draw = ImageDraw.Draw(image)
    draw.ellipse([8, 6, 30, 28], fill=(230, 40, 30))
    draw.rectangle([0, 44, 95, 63], fill=(40, 150, 60))
    draw.ellipse([30, 32, 100, 80], fill=(50, 170, 70))
    return image


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--output-dir", default="outputs/multimodal")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)

    config = KdaMoeConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                         mlp_layer_types=["dense", "sparse"], routed_expert_hidden_size=32, intermediate_size=128),
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    )  # fmt: skip
    model = KdaMoeForConditionalGeneration(config).to(device)
    processor = KdaMoeProcessor.from_package(vision_config=config.vision_config, max_patches=64)
    image = bundled_image()
    question = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What do you see?"}]}]  # fmt: skip
    answer = "A red sun over a green hill."
    print(f"kda-moe {kda_moe.__version__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    # Teach the answer (loss on the assistant turn only).
    prompt = processor.apply_chat_template(question, add_generation_prompt=True)
    full = processor.apply_chat_template(question + [{"role": "assistant", "content": answer}])
    batch = processor(images=[image], text=full, return_tensors="pt").to(device)
    prompt_len = processor(images=[image], text=prompt, return_tensors="pt")["input_ids"].shape[1]
    labels = batch["input_ids"].clone()
    labels[:, :prompt_len] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.1f}s)")

    model.save_pretrained(args.output_dir)
    processor.save_pretrained(args.output_dir)
    model = AutoModelForImageTextToText.from_pretrained(args.output_dir).to(device).eval()
    processor = AutoProcessor.from_pretrained(args.output_dir)

    inputs = processor.apply_chat_template(
        question, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    ).to(device)
    end_of_turn = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=end_of_turn)
    reply = processor.post_process_image_text_to_text(output[:, inputs["input_ids"].shape[1] :])[0]
    print(f"image {image.size[0]}x{image.size[1]} -> {int(inputs['image_grid_thw'][0].prod()) // 4} image tokens")
    print("user: What do you see?")
    print(f"assistant: {reply}")


if __name__ == "__main__":
    main()
