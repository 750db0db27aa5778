//! The captcha picture: digits drawn as pen strokes, crowded, crossed and bent, sent as a
//! compressed PNG.
//! The answer is never in the response as text; reading it takes eyes (or real OCR).
//! Pure functions: the answer and a seed in, image bytes out; no I/O, no state.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const WIDTH: usize = 200;
pub const HEIGHT: usize = 72;

/// Each digit as pen strokes in a unit box (x right, y down), shaped like handwriting.
fn strokes(digit: u8) -> Vec<Vec<(f32, f32)>> {
    let oval = (0..=24)
        .map(|i| {
            let t = i as f32 / 24.0 * std::f32::consts::TAU;
            (0.5 + 0.42 * t.sin(), 0.5 - 0.5 * t.cos())
        })
        .collect();
    match digit {
        0 => vec![oval],
        1 => vec![vec![(0.25, 0.22), (0.55, 0.0), (0.55, 1.0)]],
        2 => vec![vec![
            (0.1, 0.25),
            (0.3, 0.02),
            (0.7, 0.02),
            (0.9, 0.25),
            (0.85, 0.45),
            (0.1, 1.0),
            (0.95, 1.0),
        ]],
        3 => vec![vec![
            (0.1, 0.1),
            (0.5, 0.0),
            (0.85, 0.15),
            (0.85, 0.35),
            (0.45, 0.5),
            (0.9, 0.65),
            (0.9, 0.88),
            (0.5, 1.0),
            (0.1, 0.9),
        ]],
        4 => vec![vec![(0.7, 1.0), (0.7, 0.0), (0.05, 0.7), (0.95, 0.7)]],
        5 => vec![vec![
            (0.9, 0.0),
            (0.15, 0.0),
            (0.1, 0.45),
            (0.5, 0.38),
            (0.88, 0.55),
            (0.88, 0.85),
            (0.5, 1.0),
            (0.1, 0.9),
        ]],
        6 => vec![vec![
            (0.8, 0.05),
            (0.4, 0.1),
            (0.12, 0.5),
            (0.15, 0.85),
            (0.5, 1.0),
            (0.85, 0.85),
            (0.85, 0.6),
            (0.5, 0.48),
            (0.15, 0.65),
        ]],
        7 => vec![vec![(0.05, 0.0), (0.95, 0.0), (0.4, 1.0)]],
        8 => vec![vec![
            (0.5, 0.48),
            (0.15, 0.3),
            (0.2, 0.05),
            (0.5, 0.0),
            (0.8, 0.05),
            (0.85, 0.3),
            (0.5, 0.48),
            (0.1, 0.7),
            (0.2, 0.95),
            (0.5, 1.0),
            (0.8, 0.95),
            (0.9, 0.7),
            (0.5, 0.48),
        ]],
        _ => vec![vec![
            (0.85, 0.35),
            (0.5, 0.52),
            (0.15, 0.35),
            (0.2, 0.08),
            (0.5, 0.0),
            (0.85, 0.15),
            (0.85, 0.4),
            (0.75, 1.0),
        ]],
    }
}

/// A grayscale picture in ink coverage (0 = paper, 1 = full ink), drawn with soft edges.
struct Canvas {
    ink: Vec<f32>,
}

impl Canvas {
    fn new() -> Self {
        Canvas {
            ink: vec![0.0; WIDTH * HEIGHT],
        }
    }

    /// A round pen of `radius` at (x, y), its edge smoothed over one pixel.
    fn dot(&mut self, x: f32, y: f32, radius: f32, ink: f32) {
        let r = radius.ceil() as i32 + 1;
        for dy in -r..=r {
            for dx in -r..=r {
                let (px, py) = (x.round() as i32 + dx, y.round() as i32 + dy);
                if px < 0 || py < 0 || px >= WIDTH as i32 || py >= HEIGHT as i32 {
                    continue;
                }
                let d = (px as f32 - x).hypot(py as f32 - y);
                let cover = (radius + 0.5 - d).clamp(0.0, 1.0) * ink;
                let p = &mut self.ink[py as usize * WIDTH + px as usize];
                *p = p.max(cover);
            }
        }
    }

    fn line(&mut self, (x0, y0): (f32, f32), (x1, y1): (f32, f32), radius: f32, ink: f32) {
        let steps = ((x1 - x0).hypot(y1 - y0) * 2.0).ceil().max(1.0) as usize;
        for i in 0..=steps {
            let t = i as f32 / steps as f32;
            self.dot(x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, radius, ink);
        }
    }

    /// A smooth curve through `points` (Catmull-Rom), as a pen stroke.
    fn curve(&mut self, points: &[(f32, f32)], radius: f32, ink: f32) {
        if points.len() < 2 {
            return;
        }
        let at = |i: isize| points[i.clamp(0, points.len() as isize - 1) as usize];
        let mut last = points[0];
        for i in 0..points.len() as isize - 1 {
            let (p0, p1, p2, p3) = (at(i - 1), at(i), at(i + 1), at(i + 2));
            for k in 1..=8 {
                let t = k as f32 / 8.0;
                let (t2, t3) = (t * t, t * t * t);
                let f = |a: f32, b: f32, c: f32, d: f32| {
                    0.5 * (2.0 * b
                        + (c - a) * t
                        + (2.0 * a - 5.0 * b + 4.0 * c - d) * t2
                        + (3.0 * b - a - 3.0 * c + d) * t3)
                };
                let next = (f(p0.0, p1.0, p2.0, p3.0), f(p0.1, p1.1, p2.1, p3.1));
                self.line(last, next, radius, ink);
                last = next;
            }
        }
    }

    /// The picture bent by two waves (rows sideways, columns up and down), so that no
    /// line of text is straight and no digit keeps the shape a font would give it.
    fn warp(&self, rng: &mut StdRng) -> Canvas {
        let (ax, px, fx) = (
            rng.random_range(2.0..3.0f32),
            rng.random_range(28.0..40.0f32),
            rng.random_range(0.0..std::f32::consts::TAU),
        );
        let (ay, py, fy) = (
            rng.random_range(2.0..3.5f32),
            rng.random_range(70.0..100.0f32),
            rng.random_range(0.0..std::f32::consts::TAU),
        );
        let mut out = Canvas::new();
        for y in 0..HEIGHT {
            for x in 0..WIDTH {
                let sx = x as f32 + ax * (std::f32::consts::TAU * y as f32 / px + fx).sin();
                let sy = y as f32 + ay * (std::f32::consts::TAU * x as f32 / py + fy).sin();
                out.ink[y * WIDTH + x] = self.sample(sx, sy);
            }
        }
        out
    }

    fn sample(&self, x: f32, y: f32) -> f32 {
        if x < 0.0 || y < 0.0 || x > (WIDTH - 1) as f32 || y > (HEIGHT - 1) as f32 {
            return 0.0;
        }
        let (x0, y0) = (x.floor() as usize, y.floor() as usize);
        let (x1, y1) = ((x0 + 1).min(WIDTH - 1), (y0 + 1).min(HEIGHT - 1));
        let (tx, ty) = (x - x0 as f32, y - y0 as f32);
        let p = |xx: usize, yy: usize| self.ink[yy * WIDTH + xx];
        let top = p(x0, y0) * (1.0 - tx) + p(x1, y0) * tx;
        let bottom = p(x0, y1) * (1.0 - tx) + p(x1, y1) * tx;
        top * (1.0 - ty) + bottom * ty
    }
}

/// Draws `answer` (ASCII digits) with variations from `seed`; returns a grayscale PNG.
///
/// What makes it hard for OCR and easy for a person: the digits crowd into each other
/// (no gaps to cut between them), each turned and sized on its own; two pen strokes as
/// thick and dark as the digits run through all of them; the whole picture is bent by
/// waves; the paper is blotched. Measured by `tests/captcha_ocr.rs`.
pub fn render(answer: &str, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut canvas = Canvas::new();
    let pen = rng.random_range(1.8..2.3f32);
    let n = answer.len().max(1) as f32;
    // Cells narrower than the digits: neighbours touch or overlap.
    let cell = (WIDTH as f32 - 32.0) / n;
    for (i, digit) in answer.bytes().enumerate() {
        let angle: f32 = rng.random_range(-0.3..0.3);
        let (w, h) = (rng.random_range(24.0..30.0), rng.random_range(38.0..46.0));
        let cx = 16.0 + cell * (i as f32 + 0.5) + rng.random_range(-3.0..3.0);
        let cy = HEIGHT as f32 / 2.0 + rng.random_range(-5.0..5.0);
        let (sin, cos) = angle.sin_cos();
        let shear = rng.random_range(-0.2..0.2f32);
        for stroke in strokes(digit.wrapping_sub(b'0')) {
            let points: Vec<_> = stroke
                .iter()
                .map(|&(x, y)| {
                    let (dx, dy) = (
                        (x - 0.5) * w + (y - 0.5) * h * shear + rng.random_range(-0.8..0.8),
                        (y - 0.5) * h + rng.random_range(-0.8..0.8),
                    );
                    (cx + dx * cos - dy * sin, cy + dx * sin + dy * cos)
                })
                .collect();
            canvas.curve(&points, pen * rng.random_range(0.85..1.15), 1.0);
        }
    }
    // Strike-through strokes, as thick and dark as the digits, across all of them.
    for thickness in [rng.random_range(0.75..0.9), rng.random_range(0.45..0.6)] {
        let mut points = Vec::new();
        let mut y = rng.random_range(HEIGHT as f32 * 0.3..HEIGHT as f32 * 0.7);
        let mut x = rng.random_range(-10.0..10.0f32);
        while x < WIDTH as f32 + 20.0 {
            points.push((x, y));
            x += rng.random_range(18.0..30.0);
            y = (y + rng.random_range(-10.0..10.0)).clamp(12.0, HEIGHT as f32 - 12.0);
        }
        canvas.curve(&points, pen * thickness, 1.0);
    }
    // Short scribbles: fragments that look like parts of digits.
    for _ in 0..4 {
        let start = (
            rng.random_range(0.0..WIDTH as f32),
            rng.random_range(0.0..HEIGHT as f32),
        );
        let points: Vec<_> = (0..3)
            .map(|k| {
                (
                    start.0 + k as f32 * rng.random_range(-9.0..9.0),
                    start.1 + k as f32 * rng.random_range(-9.0..9.0),
                )
            })
            .collect();
        canvas.curve(&points, pen * 0.6, rng.random_range(0.5..0.9));
    }
    let canvas = canvas.warp(&mut rng);
    // Paper: a gradient with blotches and grain; ink a little uneven.
    let (paper_l, paper_r) = (
        rng.random_range(210.0..250.0f32),
        rng.random_range(210.0..250.0f32),
    );
    let blotches: Vec<(f32, f32, f32, f32)> = (0..10)
        .map(|_| {
            (
                rng.random_range(0.0..WIDTH as f32),
                rng.random_range(0.0..HEIGHT as f32),
                rng.random_range(6.0..16.0),
                rng.random_range(30.0..80.0),
            )
        })
        .collect();
    let ink_level = rng.random_range(20.0..60.0f32);
    let mut gray = Vec::with_capacity(WIDTH * HEIGHT);
    for y in 0..HEIGHT {
        for x in 0..WIDTH {
            let mut paper = paper_l + (paper_r - paper_l) * x as f32 / WIDTH as f32;
            for &(bx, by, r, depth) in &blotches {
                let d = (x as f32 - bx).hypot(y as f32 - by);
                if d < r {
                    paper -= depth * (1.0 - d / r);
                }
            }
            paper += rng.random_range(-8.0..8.0);
            let ink = canvas.ink[y * WIDTH + x];
            let value = paper * (1.0 - ink) + (ink_level + rng.random_range(-8.0..8.0)) * ink;
            gray.push(value.clamp(0.0, 255.0) as u8);
        }
    }
    encode_png(&gray, WIDTH, HEIGHT)
}

/// A compressed 8-bit grayscale PNG.
pub fn encode_png(gray: &[u8], width: usize, height: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(gray.len() / 2);
    let mut encoder = png::Encoder::new(&mut out, width as u32, height as u32);
    encoder.set_color(png::ColorType::Grayscale);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::High);
    // Writing into memory cannot fail; a size mismatch is a bug caught by the tests.
    let written = encoder
        .write_header()
        .and_then(|mut w| w.write_image_data(gray));
    debug_assert!(written.is_ok(), "{written:?}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_picture_is_a_compressed_png_that_differs_per_seed_and_holds_no_text() {
        let a = render("40719", 1);
        let decoder = png::Decoder::new(std::io::Cursor::new(&a));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (WIDTH as u32, HEIGHT as u32));
        assert_eq!(info.color_type, png::ColorType::Grayscale);
        assert_ne!(a, render("40719", 2), "same answer, another picture");
        assert!(!a.windows(5).any(|w| w == b"40719"));
        assert!(a.len() < WIDTH * HEIGHT, "compressed: {} bytes", a.len());
        // Ink: digits are drawn, not left blank.
        let dark = buf[..WIDTH * HEIGHT].iter().filter(|&&p| p < 100).count();
        assert!(dark > WIDTH * HEIGHT / 20, "{dark} dark pixels");
    }
}
