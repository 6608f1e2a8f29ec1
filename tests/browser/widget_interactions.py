"""Which widget to move in each notebook, and how to tell that the display changed.

`INTERACTIONS` maps a notebook's name (without .ipynb) to what a person does with one of its
widgets. A notebook with widgets and no entry gets `FALLBACK`: use the first control of its first
widget view that has one (drag a slider, click a button, pick the next option of a dropdown).
Either way the widget's *display* must change: the text of its HTML and Output parts and the
pictures in it (the controls' own labels and readouts do not count, so moving a slider that drives
nothing fails). Add an entry when the fallback picks a control that shows nothing new, or to test
the control that matters most:

    "03_gradient_accumulation": Interaction("drag the micro-batches slider",
                                            lambda view: slider(view, "micro-batches"), drag),
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from playwright.sync_api import Locator


def slider(view: "Locator", label: str) -> "Locator":
    """The handle of the slider described as `label` in a widget view."""
    row = view.locator(".widget-slider").filter(
        has=view.page.locator("label.widget-label", has_text=label))
    return row.locator(".noUi-handle")


def drag(handle: "Locator", *, pixels: float = 80) -> None:
    """Drag a slider handle by `pixels` with the mouse, towards the side with more room."""
    track = handle.locator("xpath=ancestor::*[contains(@class,'noUi-target')][1]").bounding_box()
    box = handle.bounding_box()
    assert track and box, "the slider is not visible"
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    step = pixels if x < track["x"] + track["width"] / 2 else -pixels
    mouse = handle.page.mouse
    mouse.move(x, y)
    mouse.down()
    mouse.move(x + step, y, steps=8)
    mouse.up()


def click(control: "Locator") -> None:
    control.click()


def act_on_any(control: "Locator") -> None:
    """What a person would do with a control of unknown kind: drag, click or choose."""
    classes = control.get_attribute("class") or ""
    if "noUi-handle" in classes:
        drag(control)
    elif control.evaluate("e => e.tagName") == "SELECT":
        options = control.locator("option").all_text_contents()
        current = control.evaluate("e => e.selectedIndex")
        control.select_option(index=(current + 1) % len(options))
    else:
        control.click()


@dataclasses.dataclass(frozen=True)
class Interaction:
    what: str                                   # for messages: "drag the learning-rate slider"
    control: Callable[["Locator"], "Locator"]   # finds the control inside one widget view
    act: Callable[["Locator"], None]            # what a person does with it


FALLBACK = Interaction(
    "use the first slider, button or dropdown",
    lambda view: view.locator(".noUi-handle").or_(view.locator("button")).or_(
        view.locator("select")).first,
    act_on_any)

INTERACTIONS: dict[str, Interaction] = {
    "00_memory_anatomy": Interaction("drag the parameters slider of the memory calculator",
                                     lambda view: slider(view, "parameters"), drag),
    "01_gradient_descent": Interaction("drag the learning-rate slider of gd_explorer",
                                       lambda view: slider(view, "learning rate"), drag),
    "02_float_formats": Interaction("click the sign bit of float_explorer",
                                    lambda view: view.locator('button[title^="sign bit"]'), click),
    "09_capstone": Interaction("drag the device-budget slider of plan_explorer",
                               lambda view: slider(view, "device budget"), drag),
}

# What a widget view displays, as one string: HTML parts, Output parts, and a hash of each picture.
DISPLAY_JS = """view => {
    const hash = s => {
        let h = 5381;
        for (let i = 0; i < s.length; i++) h = (h * 33 + s.charCodeAt(i)) | 0;
        return h;
    };
    const parts = [];
    const shown = '.widget-html-content, .widget-htmlmath-content, .widget-output';
    for (const e of view.querySelectorAll(shown)) parts.push(e.innerText);
    for (const img of view.querySelectorAll('img')) parts.push('img:' + hash(img.src));
    return parts.join('\\n');
}"""
