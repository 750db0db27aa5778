//! The captcha picture: digits drawn as jittered pen strokes over noise, sent as a PNG.
//! The answer is never in the response as text; reading it takes eyes (or real OCR).
//! Pure functions: the answer and a seed in, image bytes out; no I/O, no state.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const WIDTH: usize = 180;
pub const HEIGHT: usize = 64;

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
        7 => vec![
            vec![(0.05, 0.0), (0.95, 0.0), (0.4, 1.0)],
            vec![(0.35, 0.5), (0.85, 0.5)],
        ],
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

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new(rng: &mut StdRng) -> Self {
        let px = (0..WIDTH * HEIGHT)
            .map(|_| rng.random_range(205..=255))
            .collect();
        Canvas { px }
    }

    fn dot(&mut self, x: f32, y: f32, radius: f32, ink: u8) {
        let r = radius.ceil() as i32;
        for dy in -r..=r {
            for dx in -r..=r {
                let (px, py) = (x as i32 + dx, y as i32 + dy);
                if px < 0 || py < 0 || px >= WIDTH as i32 || py >= HEIGHT as i32 {
                    continue;
                }
                if ((dx * dx + dy * dy) as f32) <= radius * radius {
                    let p = &mut self.px[py as usize * WIDTH + px as usize];
                    *p = (*p).min(ink);
                }
            }
        }
    }

    fn line(&mut self, (x0, y0): (f32, f32), (x1, y1): (f32, f32), radius: f32, ink: u8) {
        let steps = ((x1 - x0).hypot(y1 - y0) * 2.0).ceil().max(1.0) as usize;
        for i in 0..=steps {
            let t = i as f32 / steps as f32;
            self.dot(x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, radius, ink);
        }
    }
}

/// Draws `answer` (ASCII digits) with jitter from `seed`, returns a grayscale PNG.
pub fn render(answer: &str, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut canvas = Canvas::new(&mut rng);
    // Distractor strokes first, thinner and lighter than the digits.
    for _ in 0..6 {
        let mut at = (
            rng.random_range(0.0..WIDTH as f32),
            rng.random_range(0.0..HEIGHT as f32),
        );
        for _ in 0..4 {
            let next = (
                (at.0 + rng.random_range(-40.0..40.0)).clamp(0.0, WIDTH as f32),
                (at.1 + rng.random_range(-20.0..20.0)).clamp(0.0, HEIGHT as f32),
            );
            canvas.line(at, next, 0.8, rng.random_range(90..150));
            at = next;
        }
    }
    let cell = WIDTH as f32 / (answer.len().max(1) as f32 + 0.6);
    for (i, digit) in answer.bytes().enumerate() {
        let angle: f32 = rng.random_range(-0.3..0.3);
        let (w, h) = (rng.random_range(18.0..24.0), rng.random_range(32.0..40.0));
        let cx = cell * (i as f32 + 0.8) + rng.random_range(-4.0..4.0);
        let cy = HEIGHT as f32 / 2.0 + rng.random_range(-5.0..5.0);
        let ink = rng.random_range(10..70);
        let (sin, cos) = angle.sin_cos();
        let place = |(x, y): (f32, f32), rng: &mut StdRng| {
            let (dx, dy) = (
                (x - 0.5) * w + rng.random_range(-1.0..1.0),
                (y - 0.5) * h + rng.random_range(-1.0..1.0),
            );
            (cx + dx * cos - dy * sin, cy + dx * sin + dy * cos)
        };
        for stroke in strokes(digit.wrapping_sub(b'0')) {
            let points: Vec<_> = stroke.iter().map(|p| place(*p, &mut rng)).collect();
            for pair in points.windows(2) {
                canvas.line(pair[0], pair[1], 1.7, ink);
            }
        }
    }
    for _ in 0..250 {
        let (x, y) = (
            rng.random_range(0.0..WIDTH as f32),
            rng.random_range(0.0..HEIGHT as f32),
        );
        canvas.dot(x, y, 0.6, rng.random_range(40..160));
    }
    encode_png(&canvas.px, WIDTH, HEIGHT)
}

/// A minimal PNG (8-bit grayscale, stored deflate blocks). A captcha is a few KiB, so
/// compression would save little; this keeps an image codec out of the dependencies.
pub fn encode_png(gray: &[u8], width: usize, height: usize) -> Vec<u8> {
    let mut raw = Vec::with_capacity((width + 1) * height);
    for row in gray.chunks(width) {
        raw.push(0); // filter: none
        raw.extend_from_slice(row);
    }
    let mut zlib = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = raw.chunks(65_535).collect();
    for (i, block) in blocks.iter().enumerate() {
        zlib.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        zlib.extend_from_slice(&len.to_le_bytes());
        zlib.extend_from_slice(&(!len).to_le_bytes());
        zlib.extend_from_slice(block);
    }
    zlib.extend_from_slice(&adler32(&raw).to_be_bytes());

    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut header = Vec::with_capacity(13);
    header.extend_from_slice(&(width as u32).to_be_bytes());
    header.extend_from_slice(&(height as u32).to_be_bytes());
    header.extend_from_slice(&[8, 0, 0, 0, 0]); // depth 8, grayscale, no interlace
    chunk(&mut png, b"IHDR", &header);
    chunk(&mut png, b"IDAT", &zlib);
    chunk(&mut png, b"IEND", &[]);
    png
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn adler32(bytes: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for &x in bytes {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    (b << 16) | a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_match_their_reference_values() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn the_picture_is_a_png_that_differs_per_seed_and_holds_no_text() {
        let a = render("40719", 1);
        assert!(a.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert_eq!(&a[12..16], b"IHDR");
        assert!(a.ends_with(&[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]));
        assert_ne!(a, render("40719", 2), "same answer, another picture");
        assert!(!a.windows(5).any(|w| w == b"40719"));
        // Ink: digits are drawn, not left blank.
        let raw_len = (WIDTH + 1) * HEIGHT;
        assert!(a.len() > raw_len);
    }
}
